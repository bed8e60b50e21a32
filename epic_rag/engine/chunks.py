"""Chunk resolution: find each chunk's tokens and KV, compiling the missing ones in vLLM batches.

Compile = a chunk submitted to vLLM behind the compile lead (`prompt.compile_lead`: the default prompt up to
its first document, whose first token is the sink) as an ordinary request (max_tokens=1); the connector copies
the sink's and the chunk's freshly computed KV out of the paged cache into a Capture after the step, and the
record ([sink] + chunk, see Capture) is stored. Many callers wanting the same missing chunk compile it once:
within a process by single flight, across processes sharing a store (replicas on one Redis) by the store's
compile lock (`ChunkStore.compile_lock`): one compiles, the others wait for its entry and load it.
The glue before a prompt's first chunk is compiled bare ("plain": it sits at position 0 in the prompt too).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from ..keys import chunk_key
from ..policy import SINK_LEN, Policy
from ..prompt import check_chunk_text, encode_text
from ..store import ChunkKV, ChunkStore, MemoryStore
from ..types import Chunk, ChunkRef, PlacedChunk
from .board import BOARD, Capture, LinkSpan
from .runtime import Runtime

log = logging.getLogger(__name__)

MIN_EXACT_PREFIX = 8  # shorter leading glue is simply recomputed
TOKEN_INDEX_SIZE = 100_000  # chunk key -> token ids remembered, so `full` never loads KV to read tokens
# The glue before the first chunk (system prompt, instructions) is client-controlled: its KV stays in this
# bounded process-private LRU and never reaches the shared tiers, where every new system prompt would add
# an entry no budget was set for.
LEAD_CACHE_BYTES = 256 << 20


class ChunkResolver:
    """Tokens and KV of chunks for one engine (model, tokenizer and KV dtype fixed by `fingerprint`)."""

    def __init__(
        self,
        store: ChunkStore,
        runtime: Runtime,
        tokenizer,
        fingerprint: str,
        kv_info: dict,
        max_model_len: int,
        lead: list[int],
    ) -> None:
        self.store, self.runtime, self.tokenizer = store, runtime, tokenizer
        self.fingerprint, self.kv_info, self.max_model_len = fingerprint, kv_info, max_model_len
        self.lead = lead  # every chunk is compiled behind these tokens (prompt.compile_lead)
        self.sink_token = self.lead[0]
        # The compile variant names the lead: another template or instruction never hits these records.
        # (The sink alone keeps its historic name, so records compiled that way before stay valid.)
        digest = hashlib.sha256(array("q", self.lead).tobytes()).hexdigest()[:8]
        self.variant = f"sink{SINK_LEN}" if len(self.lead) == SINK_LEN else f"lead{digest}"
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self.compiled = 0  # chunks (and glue) compiled by this engine; those another process compiled are loaded
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()
        self.glue = MemoryStore(max_bytes=LEAD_CACHE_BYTES)  # (see LEAD_CACHE_BYTES)

    def key(self, token_ids: Sequence[int], variant: str) -> str:
        return chunk_key(self.fingerprint, token_ids, variant)

    def chunk_tokens(self, text: str) -> list[int]:
        ids = encode_text(self.tokenizer, check_chunk_text(text))
        if not ids:
            raise ValueError("chunk text encodes to no tokens")
        if len(ids) + len(self.lead) + 1 >= self.max_model_len:
            raise ValueError(f"chunk of {len(ids)} tokens exceeds the context window ({self.max_model_len})")
        return ids

    def remember(self, key: str, token_ids: list[int]) -> None:
        with self._lock:
            self._tokens[key] = token_ids
            self._tokens.move_to_end(key)
            while len(self._tokens) > TOKEN_INDEX_SIZE:
                self._tokens.popitem(last=False)

    def place(self, seg: Chunk | ChunkRef) -> PlacedChunk:
        """A chunk's tokens, found without loading its KV where possible: the token index, then the ref's
        text; only a bare key of a chunk compiled elsewhere is read from the store."""
        if isinstance(seg, Chunk):
            return PlacedChunk(self.chunk_tokens(seg.text))
        with self._lock:
            ids = self._tokens.get(seg.key)
        if ids is not None:
            return PlacedChunk(ids)
        if seg.text is not None:
            return PlacedChunk(self.chunk_tokens(seg.text))
        kv = self.store.get(seg.key)
        if kv is None:
            raise ValueError(f"chunk {seg.key!r} is not in the store and carries no text to recompile")
        ids = self.record_tokens(kv)
        if ids is None:
            raise ValueError(f"chunk {seg.key!r} in the store was not compiled behind this engine's sink")
        self.remember(seg.key, ids)
        return PlacedChunk(ids, kv=kv)

    def record_tokens(self, kv: ChunkKV) -> list[int] | None:
        """The tokens a stored record was keyed by: a chunk record's without its sink, which must be this
        engine's (else None); a plain record's as they are."""
        if not kv.key.startswith(self.variant + "-"):
            return kv.token_ids
        if kv.token_ids[:SINK_LEN] != [self.sink_token] * SINK_LEN:
            return None
        return kv.token_ids[SINK_LEN:]

    def compile(self, texts: Sequence[str], batch_size: int) -> list[ChunkRef]:
        """Compile chunk texts not stored yet, `batch_size` per vLLM batch; refs in input order."""
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        toks = [self.chunk_tokens(t) for t in texts]
        keys = [self.key(tk, self.variant) for tk in toks]
        # An existence check, not a load: re-compiling a stored corpus must not read all its KV back.
        missing = [(tk, self.variant) for tk, key in zip(toks, keys) if not self.store.contains(key)]
        for i in range(0, len(missing), batch_size):
            self.resolve(missing[i : i + batch_size])
        for key, tk in zip(keys, toks):
            self.remember(key, tk)
        return [ChunkRef(key, len(tk), t) for key, tk, t in zip(keys, toks, texts)]

    def link_spans(self, token_ids: list[int], chunks: list[PlacedChunk], policy: Policy) -> tuple[list[LinkSpan], int]:
        """The spans a request links under `policy`, compiling what is missing; and how many chunks were
        compiled here (misses)."""
        wanted = [(c.token_ids, self.variant) for c in chunks]
        known = {c.kv.key: c.kv for c in chunks if c.kv is not None}
        kvs, misses = self.resolve(wanted, known)
        # A record holds [sink] + chunk: the span starts at the sink where the prompt keeps it.
        spans = [LinkSpan(c.start - c.sink, kv if c.sink else kv.slice(SINK_LEN)) for c, kv in zip(chunks, kvs)]
        # The glue before the first chunk (system prompt, instructions) sits at position 0 with no context
        # before it: its compiled KV is exact, so it is linked like a chunk and never recomputed.
        lead = chunks[0].start - chunks[0].sink
        if lead >= MIN_EXACT_PREFIX:
            (prefix_kv,), _ = self.resolve([(token_ids[:lead], "plain")], store=self.glue)
            spans.insert(0, LinkSpan(0, prefix_kv, exact=True))
        return spans, misses

    def resolve(
        self,
        wanted: list[tuple[list[int], str]],
        known: dict[str, ChunkKV] | None = None,
        store: ChunkStore | None = None,
    ) -> tuple[list[ChunkKV], int]:
        """Every chunk's KV (from `known`, already loaded, or `store`, default the engine's), compiling the
        missing ones in one vLLM batch (single flight, and once across the processes sharing `store`) and
        storing them there. Returns the KVs in order and how many were compiled here."""
        store = self.store if store is None else store
        results: list[ChunkKV | None] = [None] * len(wanted)
        waits: list[tuple[int, Future]] = []
        mine: dict[str, tuple[Future, list[int], str]] = {}
        for i, (tokens, variant) in enumerate(wanted):
            key = self.key(tokens, variant)
            kv = (known or {}).get(key) or store.get(key)
            if kv is not None:
                results[i] = kv
                continue
            with self._lock:
                fut = self._inflight.get(key)
                if fut is None:
                    fut = Future()
                    self._inflight[key] = fut
                    mine[key] = (fut, tokens, variant)
            waits.append((i, fut))
        compiled = self._compile_once(mine, store) if mine else 0
        for i, fut in waits:
            results[i] = fut.result()
        return results, compiled  # type: ignore[return-value]

    def _compile_once(self, todo: dict[str, tuple[Future, list[int], str]], store: ChunkStore) -> int:
        """Resolve the futures of `todo` (chunks this thread leads), compiling each chunk once among the
        processes sharing `store`: those whose compile lock this process takes are compiled here in one
        batch (the lock released once they are stored); the others are being compiled by another process,
        whose entries are waited for and loaded, or compiled here after all when it dies or gives up.
        Returns how many were compiled here."""
        locks = {}
        compiled = 0
        try:
            for key in todo:
                locks[key] = store.compile_lock(key)
            batch = {key: job for key, job in todo.items() if locks[key].acquire()}
            if batch:
                self._compile_batch(batch, store)
                compiled += len(batch)
                for key in batch:  # stored: a process waiting for them finds them now
                    locks[key].release()
            for key, (fut, tokens, variant) in todo.items():
                if key in batch:
                    continue
                kv = locks[key].wait()
                if kv is not None:
                    fut.set_result(kv)
                    continue
                self._compile_batch({key: (fut, tokens, variant)}, store)
                compiled += 1
                locks[key].release()
        except BaseException as e:
            for fut, _, _ in todo.values():
                if not fut.done():
                    fut.set_exception(e)
            raise
        finally:
            for lock in locks.values():
                lock.release()
            with self._lock:
                self.compiled += compiled
                for key in todo:
                    self._inflight.pop(key, None)
        return compiled

    def _compile_batch(self, todo: dict[str, tuple[Future, list[int], str]], store: ChunkStore) -> None:
        info = self.kv_info
        L, H, D = info["num_layers"], info["num_kv_heads"], info["head_size"]
        kv_dtype = getattr(torch, info["kv_dtype"].removeprefix("torch."))
        done: list[tuple[str, str, Capture, list[int], list[int], Future, threading.Event]] = []
        submitted: list[str] = []  # vLLM request ids, aborted if the batch fails part-way
        try:
            for key, (fut, tokens, variant) in todo.items():
                lead = self.lead if variant == self.variant else []
                prompt = lead + tokens
                record = lead[:SINK_LEN] + tokens  # the sink and the chunk (see Capture)
                cap = Capture(
                    k=torch.empty((L, len(record), H, D), dtype=kv_dtype),
                    v=torch.empty((L, len(record), H, D), dtype=kv_dtype),
                    lead=max(len(lead), 1),
                )
                cap_id = uuid.uuid4().hex
                BOARD.post_capture(cap_id, cap)
                ev = threading.Event()
                done.append((key, cap_id, cap, prompt, record, fut, ev))
                submitted.append(
                    self.runtime.submit_tokens(
                        prompt, event_sink(ev), max_tokens=1, kv_params={"epic": {"capture": cap_id}}
                    )
                )
            for key, cap_id, cap, prompt, record, fut, ev in done:
                self.runtime.wait_for(ev)
                BOARD.pop_capture(cap_id)
                err = getattr(ev, "error", None) or cap.error
                if err is None and cap.filled_to < len(prompt):
                    err = f"captured {cap.filled_to} of {len(prompt)} tokens"
                if err is not None:
                    raise RuntimeError(f"compiling chunk {key} failed: {err}")
                # keys at positions lead-1 (the sink, moved there) onwards
                kv = ChunkKV(key=key, token_ids=record, k=cap.k, v=cap.v, base_pos=cap.lead - 1)
                try:
                    store.put(kv)
                except Exception:
                    log.exception("storing chunk %s failed; serving it from this compile", key)
                fut.set_result(kv)
        except BaseException as e:
            for req_id in submitted:  # no-op for those already finished
                self.runtime.abort(req_id)
            for _, cap_id, *_ in done:  # nothing left on the board
                BOARD.pop_capture(cap_id)
            for *_, fut, _ in done:
                if not fut.done():
                    fut.set_exception(e)
            for fut, _, _ in todo.values():
                if not fut.done():
                    fut.set_exception(e)
            raise


def event_sink(ev: threading.Event) -> Callable:
    """A runtime sink that only signals the request's end (or its error, as `ev.error`)."""

    def sink(d):
        if isinstance(d, BaseException):
            ev.error = f"{type(d).__name__}: {d}"  # type: ignore[attr-defined]
            ev.set()
        elif d.finished:
            ev.set()

    return sink
