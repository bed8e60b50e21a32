"""Chunk resolution: find each chunk's tokens, make sure its record is stored, compiling the missing ones.

Compile = a chunk submitted to vLLM behind the compile lead (`prompt.compile_lead`: the default prompt up to
its first document, whose first token is the sink) as an ordinary request carrying a compile job (jobs.py);
the connector copies the sink's and the chunk's freshly computed KV out of the paged cache and stores the
record ([sink] + chunk, see jobs.Capture) from the worker, reporting the outcome in the request's output.
Many callers wanting the same missing chunk compile it once: within a process by single flight, across
processes sharing a store (replicas on one Redis) by the store's compile lock (`ChunkStore.compile_lock`):
one compiles, the others wait for its entry.
The glue before a prompt's first chunk is compiled bare ("plain": it sits at position 0 in the prompt too)
into the glue store (stores.py). The engine never loads chunk KV itself: the worker reads it when it links.

Neighbour-aware compile (`refine`, FusionRAG's offline stage): a chunk compiled again behind its nearest
neighbours (each a document of the template before it) gets a record of its own, keyed by that lead (so by the
neighbour set: never its plain record), and links of that chunk use it from then on. Its KV has seen records
like it: a record compiled alone looks like the first of its kind, which misleads lookups among look-alikes.
Like every chunk span its link is approximate, scoped, never an exact prefix-cache block.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from ..keys import DEFAULT_TENANT, chunk_key, compile_variant, lead_id, rank_key, tenant_id
from ..policy import SINK_LEN, Policy
from ..prompt import check_chunk_text, encode_text
from ..store import ChunkKV, ChunkStore
from ..types import Chunk, ChunkRef, PlacedChunk
from .connector.tenancy import shared_salt
from .jobs import CompileRequest, SpanRef
from .runtime import Runtime
from .stores import ChunkStores

log = logging.getLogger(__name__)

MIN_EXACT_PREFIX = 8  # shorter leading glue is simply recomputed
TOKEN_INDEX_SIZE = 100_000  # chunk key -> token ids remembered, so `full` never loads KV to read tokens
STORED_INDEX_SIZE = 100_000  # keys the worker reported stored (its memory tier is not visible from here)
REFINED_INDEX_SIZE = 20_000  # chunks whose neighbour-aware record links use (with their leads, ~5 KB each)


class ChunkResolver:
    """Tokens and KV of chunks for one engine (model, tokenizer and KV dtype fixed by `fingerprint`)."""

    def __init__(
        self,
        stores: ChunkStores,
        runtime: Runtime,
        tokenizer,
        fingerprint: str,
        kv_info: dict,
        max_model_len: int,
        lead: list[int],
        tenant: str = DEFAULT_TENANT,
        lead_behind: Callable[[list[list[int]]], list[int]] | None = None,
    ) -> None:
        self.stores, self.runtime, self.tokenizer = stores, runtime, tokenizer
        # the namespace this engine's records live in (tenancy.py): its compiles and links carry it as their
        # cache_salt's namespace, so the worker derives the keys computed here
        self.tenant, self.tenant_id = tenant, tenant_id(tenant)
        self.fingerprint, self.kv_info, self.max_model_len = fingerprint, kv_info, max_model_len
        self.lead = lead  # every chunk is compiled behind these tokens (prompt.compile_lead)
        self.sink_token = self.lead[0]
        self.variant = compile_variant(self.lead)
        # the lead a chunk is compiled behind beside given neighbours (prompt.compile_lead_behind)
        self.lead_behind = lead_behind or (lambda neighbours: self.lead + [t for n in neighbours for t in n])
        # compile forms: "plain" (bare glue), self.variant (behind the engine's lead) and the refined ones
        # ("nbr-" + the lead's id) -> the lead; chunk plain key -> its refined form, least recently used first
        self._leads: dict[str, list[int]] = {"plain": [], self.variant: self.lead}
        self._refined: OrderedDict[str, str] = OrderedDict()
        self._form_uses: Counter[str] = Counter()  # chunks linked in each refined form (chunks may share a lead)
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self.compiled = 0  # chunks (and glue) compiled by this engine; those another process compiled are loaded
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()
        # Keys whose records the worker stored (its outcome), and keys a link found missing or misfiled
        # (recompiled at their next use; a misfiled entry is then overwritten).
        self._stored: OrderedDict[str, None] = OrderedDict()
        self._suspect: set[str] = set()

    @property
    def store(self) -> ChunkStore:
        return self.stores.chunks

    @store.setter
    def store(self, store: ChunkStore) -> None:
        with self._lock:  # what the worker stored before is in the old store (or spilled beside it)
            self.stores.chunks = store
            self.stores.forget_recent()
            self._stored = OrderedDict((k, None) for k in self._stored if k.startswith("plain-"))
            self._suspect.clear()

    @property
    def glue(self) -> ChunkStore:
        return self.stores.glue

    def key(self, token_ids: Sequence[int], variant: str) -> str:
        """The key of a chunk compiled behind this engine's lead (`variant` == self.variant), of bare glue
        ("plain") or of a chunk in a refined form (`refine`): the key the worker derives for the same compile
        (keys.py)."""
        return chunk_key(self.fingerprint, token_ids, self._lead_of(variant), self.tenant)

    def _lead_of(self, variant: str) -> list[int]:
        with self._lock:
            lead = self._leads.get(variant)
        if lead is None:
            raise ValueError(f"this engine compiles chunks as {self.variant!r} or 'plain', not {variant!r}")
        return lead

    def form_of(self, token_ids: Sequence[int]) -> str:
        """The form a chunk is linked in: its refined one where `refine` made one, else self.variant."""
        if not self._refined:
            return self.variant
        plain = self.key(token_ids, self.variant)
        with self._lock:
            form = self._refined.get(plain)
            if form is None:
                return self.variant
            self._refined.move_to_end(plain)
            return form

    def is_refined(self, token_ids: Sequence[int]) -> bool:
        """Whether links of this chunk use a refined record."""
        return self.form_of(token_ids) != self.variant

    def refine(self, chunks: list[list[int]], neighbours: list[list[list[int]]], batch_size: int = 8) -> list[str]:
        """Compile each chunk behind its neighbours (token lists in prompt order, the nearest last) and link it
        in that form from now on; returns the refined records' keys. A chunk refined again takes its new form."""
        if len(chunks) != len(neighbours):
            raise ValueError(f"refine: {len(chunks)} chunks but {len(neighbours)} neighbour lists")
        forms = []
        for tokens, near in zip(chunks, neighbours):
            lead = self.lead_behind([list(n) for n in near])
            if len(lead) + len(tokens) + 1 >= self.max_model_len:
                raise ValueError(
                    f"refine: a chunk behind its neighbours ({len(lead) + len(tokens)} tokens) does "
                    f"not fit the context window ({self.max_model_len})"
                )
            form = f"nbr-{lead_id(lead)}"
            with self._lock:
                self._leads[form] = lead
            forms.append(form)
        keys, wanted = [], [(list(t), f) for t, f in zip(chunks, forms)]
        for i in range(0, len(wanted), batch_size):
            keys += self.resolve(wanted[i : i + batch_size])[0]
        with self._lock:
            for tokens, form in zip(chunks, forms):
                plain = chunk_key(self.fingerprint, tokens, self.lead, self.tenant)
                self._form_uses[form] += 1  # before the old form is dropped: it may be this one
                self._drop_form(self._refined.pop(plain, None))
                self._refined[plain] = form
            while len(self._refined) > REFINED_INDEX_SIZE:
                self._drop_form(self._refined.popitem(last=False)[1])
        return keys

    def _drop_form(self, form: str | None) -> None:
        """One chunk fewer links in `form`; its lead is forgotten with its last chunk. Holds self._lock."""
        if form is None:
            return
        self._form_uses[form] -= 1
        if self._form_uses[form] <= 0:
            del self._form_uses[form]
            self._leads.pop(form, None)

    def unrefine(self, chunks: list[list[int]]) -> int:
        """Link these chunks in their plain form again (their refined records stay stored: a later refine
        behind the same neighbours finds them); returns how many had a refined form."""
        n = 0
        with self._lock:
            for tokens in chunks:
                form = self._refined.pop(chunk_key(self.fingerprint, tokens, self.lead, self.tenant), None)
                n += form is not None
                self._drop_form(form)
        return n

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
        return PlacedChunk(ids)

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
        missing = [(tk, self.variant) for tk, key in zip(toks, keys) if not self._known(key, verify=False)]
        for i in range(0, len(missing), batch_size):
            self.resolve(missing[i : i + batch_size])
        for key, tk in zip(keys, toks):
            self.remember(key, tk)
        return [ChunkRef(key, len(tk), t) for key, tk, t in zip(keys, toks, texts)]

    def link_spans(self, token_ids: list[int], chunks: list[PlacedChunk], policy: Policy) -> tuple[list[SpanRef], int]:
        """The spans a request links under `policy`, compiling what is missing; and how many chunks were
        compiled here (misses)."""
        keys, misses = self.resolve([(c.token_ids, self.form_of(c.token_ids)) for c in chunks])
        # A record holds [sink] + chunk: the span starts at the sink where the prompt keeps it.
        spans = [
            SpanRef(key, SINK_LEN - c.sink, c.start - c.sink, c.sink + len(c.token_ids)) for key, c in zip(keys, chunks)
        ]
        # The glue before the first chunk (system prompt, instructions) sits at position 0 with no context
        # before it: its compiled KV is exact, so it is linked like a chunk and never recomputed.
        lead = chunks[0].start - chunks[0].sink
        if lead >= MIN_EXACT_PREFIX:
            (glue_key,), _ = self.resolve([(token_ids[:lead], "plain")])
            spans.insert(0, SpanRef(glue_key, 0, 0, lead, exact=True))
        return spans, misses

    def forget(self, keys: Sequence[str]) -> None:
        """Keys a link did not find (evicted, or an entry that does not hold its tokens): compiled again at
        their next use."""
        with self._lock:
            for key in keys:
                self._stored.pop(key, None)
                self._suspect.add(key)

    def _known(self, key: str, glue: bool = False, verify: bool = True) -> bool:
        """Whether a record is stored. Keys the worker reported stored are trusted; any other key (stored by
        another process, or one a link did not find) is read and checked as the worker will read it (its
        tokens hash to its key, the entry is intact) or, without `verify`, only looked up."""
        with self._lock:
            if key in self._stored and key not in self._suspect:
                self._stored.move_to_end(key)
                return True
        names = self._stored_names(key)
        if not verify:
            return all((self.glue if glue else self.store).contains(n) for n in names)
        if any(self.stores.get(n, glue) is None for n in names):
            return False
        self._mark_stored(key)
        return True

    def _stored_names(self, key: str) -> list[str]:
        """The names a record is stored under: its key, or one per tensor-parallel rank (each holds its heads)."""
        tp = self.kv_info.get("tp", [0, 1])[1]
        return [rank_key(key, r, tp) for r in range(tp)]

    def _mark_stored(self, key: str) -> None:
        with self._lock:
            self._suspect.discard(key)
            self._stored[key] = None
            self._stored.move_to_end(key)
            while len(self._stored) > STORED_INDEX_SIZE:
                self._stored.popitem(last=False)

    def resolve(self, wanted: list[tuple[list[int], str]]) -> tuple[list[str], int]:
        """Make sure every chunk's record is stored (plain glue in the glue store, chunks in the chunk
        store), compiling the missing ones in one vLLM batch (single flight, and once across the processes
        sharing the store). Returns their keys, in order, and how many were compiled here."""
        waits: list[Future] = []
        mine: dict[str, tuple[Future, list[int], str]] = {}
        keys = [self.key(tokens, variant) for tokens, variant in wanted]
        for key, (tokens, variant) in zip(keys, wanted):
            if self._known(key, glue=variant == "plain"):
                continue
            with self._lock:
                fut = self._inflight.get(key)
                if fut is None:
                    fut = Future()
                    self._inflight[key] = fut
                    mine[key] = (fut, tokens, variant)
            waits.append(fut)
        compiled = self._compile_once(mine) if mine else 0
        for fut in waits:
            fut.result()
        return keys, compiled

    def _compile_once(self, todo: dict[str, tuple[Future, list[int], str]]) -> int:
        """Resolve the futures of `todo` (chunks this thread leads), compiling each chunk once among the
        processes sharing the store: those whose compile lock this process takes are compiled here in one
        batch (the lock released once they are stored); the others are being compiled by another process,
        whose entries are waited for, or compiled here after all when it dies or gives up. Glue is
        process-private: never locked. Returns how many were compiled here."""
        locks = {key: self.store.compile_lock(key) for key, (_, _, variant) in todo.items() if variant != "plain"}
        compiled = 0
        try:
            batch = {key: job for key, job in todo.items() if key not in locks or locks[key].acquire()}
            if batch:
                self._compile_batch(batch)
                compiled += len(batch)
                for key in batch:  # stored: a process waiting for them finds them now
                    if key in locks:
                        locks[key].release()
            for key, (fut, tokens, variant) in todo.items():
                if key in batch:
                    continue
                if locks[key].wait() is not None:
                    self._mark_stored(key)
                    fut.set_result(None)
                    continue
                self._compile_batch({key: (fut, tokens, variant)})
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

    def _compile_batch(self, todo: dict[str, tuple[Future, list[int], str]]) -> None:
        """Compile `todo` in one vLLM batch: each prompt runs with a compile job, the worker stores the record
        and says so in the request's output. Two tokens are generated so the outcome, reported after the
        prefill's last step, reaches the request's end (vLLM reports a step's connector outcomes after it
        finishes the requests of that step)."""
        done: list[tuple[str, Future, threading.Event]] = []
        submitted: list[str] = []  # vLLM request ids, aborted if the batch fails part-way
        try:
            for key, (fut, tokens, variant) in todo.items():
                lead = self._lead_of(variant)
                job = CompileRequest(key, len(lead), glue=variant == "plain")
                ev = threading.Event()
                req_id = self.runtime.submit_tokens(
                    lead + tokens,
                    event_sink(ev),
                    salt=shared_salt(self.tenant),  # the lead's exact blocks are shared (worker.py captures them)
                    max_tokens=2,
                    min_tokens=2,
                    ignore_eos=True,
                    kv_params=job.to_params(),
                )
                submitted.append(req_id)
                done.append((key, fut, ev))
            for key, fut, ev in done:
                self.runtime.wait_for(ev)
                outcome = getattr(ev, "outcome", None) or {}
                err = getattr(ev, "error", None) or outcome.get("error")
                if err is None and outcome.get("stored") != key:
                    err = f"the engine reported no stored record ({outcome or 'no outcome'})"
                if err is not None:
                    raise RuntimeError(f"compiling chunk {key} failed: {err}")
                self._mark_stored(key)
                fut.set_result(None)
        except BaseException as e:
            for req_id in submitted:  # no-op for those already finished
                self.runtime.abort(req_id)
            for fut, _, _ in todo.values():
                if not fut.done():
                    fut.set_exception(e)
            raise


def event_sink(ev: threading.Event) -> Callable:
    """A runtime sink that only signals the request's end: its connector outcome as `ev.outcome`, or its
    error as `ev.error`."""

    def sink(d):
        if isinstance(d, BaseException):
            ev.error = f"{type(d).__name__}: {d}"  # type: ignore[attr-defined]
            ev.set()
        elif d.finished:
            p = (d.kv_transfer_params or {}).get("epic")
            ev.outcome = p if isinstance(p, dict) else None  # type: ignore[attr-defined]
            if d.finish_reason == "error":
                ev.error = "vLLM finished the compile with an error"  # type: ignore[attr-defined]
            ev.set()

    return sink
