"""EpicEngine: compile chunks once, link them in any order, generate (sync, streaming, async)."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..config import EngineConfig
from ..matching import ChunkTextIndex
from ..models import model_fingerprint, resolve_model, tokenizer_fingerprint
from ..policy import DUMMY_PREFIX_LEN, Policy, parse_policy
from ..prompt import check_chunk_text, encode_text, render_request
from ..store import ChunkKV, open_store
from ..types import Chunk, ChunkRef, Generation, RagRequest, Segment
from .board import BOARD, Capture
from .linker import LinkJob, LinkSpan
from .runtime import Delta, Runtime

log = logging.getLogger(__name__)

MIN_EXACT_PREFIX = 8   # shorter leading glue is simply recomputed


def _cpu_has_fast_bf16() -> bool:
    """vLLM's CPU bf16 kernels are fast only with AMX; with AVX-512/AVX2 bf16 measured ~4x slower than fp32."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "amx_bf16" in flags


def _prepare_env() -> None:
    # In-process engine core: the connector shares Python objects with the engine (see board.py).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@dataclass(slots=True)
class _Prompt:
    """A request ready for vLLM: tokens, where the chunks sit, and the linking job if any."""

    token_ids: list[int]
    spans: list[tuple[int, ChunkKV, bool]]   # (start, kv, exact: a leading prefix needing no recompute)
    hits: int
    misses: int


class EpicEngine:
    """An embedded vLLM engine with position-independent chunk caching (EPIC's compile + link)."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.default_policy = parse_policy(config.policy)
        self.model_dir = resolve_model(config.model)
        self.store = open_store(config.store)
        _prepare_env()
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(config.kv_cache_gib))
        dtype = config.dtype
        if dtype == "auto":
            dtype = "bfloat16" if (not on_cpu or _cpu_has_fast_bf16()) else "float32"
        self.dtype = dtype
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        args = EngineArgs(
            model=str(self.model_dir), dtype=dtype, max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            enforce_eager=True, enable_prefix_caching=True, seed=config.seed,
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_transfer_config=KVTransferConfig(
                kv_connector="EpicConnector", kv_connector_module_path="epic_rag.engine.connector",
                kv_role="kv_both"),
            worker_extension_cls="epic_rag.engine.connector.EpicWorkerExtension",
        )
        self._llm = LLMEngine.from_engine_args(args)
        self.kv_info = self._llm.collective_rpc("epic_attach")[0]
        self.tokenizer = self._llm.get_tokenizer()
        self._fp = kv_fingerprint(model_fingerprint(self.model_dir), tokenizer_fingerprint(self.tokenizer),
                                  self.kv_info["kv_dtype"])
        self.max_model_len = config.max_model_len
        self._inflight: dict[str, Future] = {}
        self._inflight_lock = threading.Lock()
        self.text_index = ChunkTextIndex()  # compiled chunk texts, found again inside rendered prompts
        self.runtime = Runtime(self._llm)
        self.runtime.start()

    # ------------------------------------------------------------------ keys and compile
    def chunk_key(self, token_ids: Sequence[int], variant: str = "plain") -> str:
        """Content-derived key: model, tokenizer and KV dtype fingerprint, compile variant, tokens."""
        return chunk_key(self._fp, token_ids, variant)

    def compile(self, chunks: Sequence[str], policy: str | None = None) -> list[ChunkRef]:
        """Compile chunk texts (skipping those already stored); returns refs in input order."""
        if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Iterable):
            raise ValueError(f"compile takes a list of chunk texts, got {type(chunks).__name__}")
        variant = parse_policy(policy).compile_variant if policy else self.default_policy.compile_variant
        texts = [check_chunk_text(c) for c in chunks]
        toks = [self._chunk_tokens(t) for t in texts]
        keys = [self.chunk_key(tk, variant) for tk in toks]
        # An existence check, not a load: re-compiling a stored corpus must not read all its KV back.
        missing = [(tk, variant) for tk, key in zip(toks, keys) if not self.store.contains(key)]
        if missing:
            self._resolve(missing)
        refs = [ChunkRef(key, len(tk), t) for key, tk, t in zip(keys, toks, texts)]
        for r in refs:
            self.text_index.add(r)
        return refs

    def _chunk_tokens(self, text: str) -> list[int]:
        ids = encode_text(self.tokenizer, text)
        if not ids:
            raise ValueError("chunk text encodes to no tokens")
        if len(ids) + DUMMY_PREFIX_LEN + 1 >= self.max_model_len:
            raise ValueError(f"chunk of {len(ids)} tokens exceeds the context window ({self.max_model_len})")
        return ids

    def _resolve(self, wanted: list[tuple[list[int], str]],
                 known: dict[str, ChunkKV] | None = None) -> tuple[list[ChunkKV], int]:
        """Fetch every chunk's KV (from `known`, already loaded, or the store), compiling the missing
        ones in one vLLM batch (single flight). Returns the KVs in order and how many were compiled here."""
        results: list[ChunkKV | None] = [None] * len(wanted)
        waits: list[tuple[int, Future]] = []
        mine: dict[str, tuple[Future, list[int], str]] = {}
        for i, (tokens, variant) in enumerate(wanted):
            key = self.chunk_key(tokens, variant)
            kv = (known or {}).get(key) or self.store.get(key)
            if kv is not None:
                results[i] = kv
                continue
            with self._inflight_lock:
                fut = self._inflight.get(key)
                if fut is None:
                    fut = Future()
                    self._inflight[key] = fut
                    mine[key] = (fut, tokens, variant)
            waits.append((i, fut))
        if mine:
            self._compile_batch(mine)
        for i, fut in waits:
            results[i] = fut.result()
        return results, len(mine)  # type: ignore[return-value]

    def _compile_batch(self, todo: dict[str, tuple[Future, list[int], str]]) -> None:
        info = self.kv_info
        L, H, D = info["num_layers"], info["num_kv_heads"], info["head_size"]
        kv_dtype = getattr(torch, info["kv_dtype"].removeprefix("torch."))
        bos = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id
        done: list[tuple[str, str, Capture, list[int], Future, threading.Event]] = []
        try:
            for key, (fut, tokens, variant) in todo.items():
                offset = DUMMY_PREFIX_LEN if variant.startswith("dummy") else 0
                cap = Capture(k=torch.empty((L, len(tokens), H, D), dtype=kv_dtype),
                              v=torch.empty((L, len(tokens), H, D), dtype=kv_dtype), offset=offset)
                cap_id = uuid.uuid4().hex
                BOARD.post_capture(cap_id, cap)
                ev = threading.Event()
                done.append((key, cap_id, cap, tokens, fut, ev))
                prompt = [bos] * offset + tokens
                self._submit(prompt, max_tokens=1, temperature=0.0, salt=uuid.uuid4().hex,
                             kv_params={"epic": {"capture": cap_id}}, sink=_event_sink(ev))
            for key, cap_id, cap, tokens, fut, ev in done:
                ev.wait()
                BOARD.pop_capture(cap_id)
                err = getattr(ev, "error", None) or cap.error
                if err is None and cap.filled_to < cap.offset + len(tokens):
                    err = f"captured {cap.filled_to - cap.offset} of {len(tokens)} tokens"
                if err is not None:
                    raise RuntimeError(f"compiling chunk {key} failed: {err}")
                kv = ChunkKV(key=key, token_ids=tokens, k=cap.k, v=cap.v, base_pos=cap.offset)
                try:
                    self.store.put(kv)
                except Exception:
                    log.exception("storing chunk %s failed; serving it from this compile", key)
                fut.set_result(kv)
        except BaseException as e:
            for _, _, _, _, fut, _ in done:
                if not fut.done():
                    fut.set_exception(e)
            for fut, _, _ in todo.values():
                if not fut.done():
                    fut.set_exception(e)
            raise
        finally:
            with self._inflight_lock:
                for key in todo:
                    self._inflight.pop(key, None)

    # ------------------------------------------------------------------ prompts
    def _segments(self, request: RagRequest | Sequence[Segment]) -> list[Segment]:
        if isinstance(request, RagRequest):
            return render_request(self.tokenizer, request)
        if isinstance(request, str):  # a prompt a framework rendered: compiled chunk texts in it are linked
            return self.text_index.split(request)
        if isinstance(request, bytes) or not isinstance(request, Sequence):
            raise ValueError("request must be a RagRequest, a prompt string or a list of segments "
                             "(str | Chunk | ChunkRef)")
        return list(request)

    def render_messages(self, messages: Sequence[dict]) -> list[Segment]:
        """Chat-template role/content messages (generation prompt added); compiled chunk texts found in
        the result become ChunkRef segments."""
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return self.text_index.split(text)

    def _build(self, segments: list[Segment], policy: Policy) -> _Prompt:
        ids: list[int] = []
        placed: list[tuple[int, int]] = []     # (index into wanted, start)
        wanted: list[tuple[list[int], str]] = []
        known: dict[str, ChunkKV] = {}        # ChunkRefs' KV loaded here, not loaded twice from a slow tier
        variant = policy.compile_variant
        for seg in segments:
            if isinstance(seg, str):
                ids += encode_text(self.tokenizer, seg)
                continue
            if isinstance(seg, ChunkRef):
                kv = self.store.get(seg.key)
                if kv is not None:
                    toks = kv.token_ids
                    known[kv.key] = kv
                elif seg.text is not None:
                    toks = self._chunk_tokens(seg.text)
                else:
                    raise ValueError(f"chunk {seg.key!r} is not in the store and carries no text to recompile")
            elif isinstance(seg, Chunk):
                toks = self._chunk_tokens(check_chunk_text(seg.text))
            else:
                raise ValueError(f"segment must be str, Chunk or ChunkRef, got {type(seg).__name__}")
            placed.append((len(wanted), len(ids)))
            wanted.append((toks, variant))
            ids += toks
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context window "
                             f"({self.max_model_len} tokens, one at least kept for the answer)")
        if not policy.links_chunks or not placed:
            return _Prompt(ids, [], 0, 0)
        kvs, misses = self._resolve(wanted, known)
        spans = [(start, kvs[i], False) for i, start in placed]
        # The glue before the first chunk (system prompt, instructions) sits at position 0 with no context
        # before it: its compiled KV is exact, so it is linked like a chunk and never recomputed.
        lead = placed[0][1]
        if lead >= MIN_EXACT_PREFIX:
            (prefix_kv,), _ = self._resolve([(ids[:lead], "plain")])
            spans.insert(0, (0, prefix_kv, True))
        return _Prompt(ids, spans, len(wanted) - misses, misses)

    # ------------------------------------------------------------------ generation
    def _submit(self, prompt_ids, max_tokens, temperature, salt, kv_params, sink, stop=None, seed=None) -> str:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        extra = {"kv_transfer_params": kv_params} if kv_params else None
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop, seed=seed,
                                output_kind=RequestOutputKind.DELTA, extra_args=extra)
        req_id = uuid.uuid4().hex
        self.runtime.submit(req_id, TokensPrompt(prompt_token_ids=list(prompt_ids), cache_salt=salt), params, sink)
        return req_id

    def _start(self, request, max_tokens: int, temperature: float, policy: str | None,
               stop: list[str] | None, sink) -> tuple[str, _Prompt, Policy, LinkJob | None, float]:
        pol = parse_policy(policy) if policy is not None else self.default_policy
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if not isinstance(temperature, (int, float)) or not 0.0 <= float(temperature) <= 5.0:
            raise ValueError(f"temperature must be a number in [0, 5], got {temperature!r}")
        if stop is not None and not isinstance(stop, str) and (
                not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop)):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        t0 = time.perf_counter()
        prompt = self._build(self._segments(request), pol)
        max_tokens = min(max_tokens, self.max_model_len - len(prompt.token_ids))
        job = None
        kv_params = None
        salt = "epic-prefix" if pol.kind == "prefix" else uuid.uuid4().hex  # linked KV never reused as exact
        if prompt.spans:
            last_end = max(s + kv.num_tokens for s, kv, _ in prompt.spans)
            claim = min(last_end, len(prompt.token_ids) - 1)
            # A chunk cut by the claim (prompt ends inside it) is truncated to the claimed part.
            job = LinkJob(uuid.uuid4().hex, prompt.token_ids[:claim],
                          [LinkSpan(s, _truncate(kv, claim - s), exact) for s, kv, exact in prompt.spans
                           if s < claim], pol)
            BOARD.post_job(job)
            kv_params = {"epic": {"link": job.job_id, "claim": claim}}
        try:
            req_id = self._submit(prompt.token_ids, max_tokens, float(temperature), salt, kv_params, sink, stop=stop)
        except BaseException:
            if job:
                BOARD.drop_job(job.job_id)
            raise
        return req_id, prompt, pol, job, t0

    def stream_events(self, request, max_tokens: int = 64, temperature: float = 0.0,
                      policy: str | None = None, stop: list[str] | None = None) -> Iterator[Delta | Generation]:
        """Yield each text delta as it is produced, then the final Generation."""
        import queue as _q
        box: "_q.SimpleQueue[Delta | BaseException]" = _q.SimpleQueue()
        run = _Run(self, *self._start(request, max_tokens, temperature, policy, stop, box.put))
        try:
            while True:
                d = box.get()
                done = run.feed(d)
                if d.text:
                    yield d
                if done:
                    break
        except BaseException:   # includes GeneratorExit: the consumer went away
            run.cancel()
            raise
        yield run.result()

    def generate(self, request: RagRequest | Sequence[Segment], max_tokens: int = 64, temperature: float = 0.0,
                 policy: str | None = None, stop: list[str] | None = None) -> Generation:
        """Answer one request; `policy` overrides the engine default for this request."""
        for ev in self.stream_events(request, max_tokens, temperature, policy, stop):
            if isinstance(ev, Generation):
                return ev
        raise RuntimeError("generation ended without a result")

    def stream(self, request, max_tokens: int = 64, temperature: float = 0.0, policy: str | None = None,
               stop: list[str] | None = None) -> Iterator[str]:
        """Yield text deltas."""
        for ev in self.stream_events(request, max_tokens, temperature, policy, stop):
            if isinstance(ev, Delta):
                yield ev.text

    async def astream_events(self, request, max_tokens: int = 64, temperature: float = 0.0,
                             policy: str | None = None, stop: list[str] | None = None):
        """Async form of stream_events: deltas, then the Generation. Cancelling aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def sink(d):
            loop.call_soon_threadsafe(q.put_nowait, d)

        # Prompt building may compile chunks (blocking): run it off the event loop. If the caller is
        # cancelled meanwhile, the request that setup submits is aborted as soon as it exists.
        setup = asyncio.ensure_future(asyncio.to_thread(self._start, request, max_tokens, temperature, policy,
                                                        stop, sink))
        try:
            run = _Run(self, *await asyncio.shield(setup))
        except asyncio.CancelledError:
            setup.add_done_callback(lambda f: None if f.cancelled() or f.exception() else _Run(self, *f.result()).cancel())
            raise
        try:
            while True:
                d = await q.get()
                done = run.feed(d)
                if d.text:
                    yield d
                if done:
                    break
        except BaseException:   # includes cancellation: the client went away
            run.cancel()
            raise
        yield run.result()

    async def agenerate(self, request, max_tokens: int = 64, temperature: float = 0.0,
                        policy: str | None = None, stop: list[str] | None = None) -> Generation:
        async for ev in self.astream_events(request, max_tokens, temperature, policy, stop):
            if isinstance(ev, Generation):
                return ev
        raise RuntimeError("generation ended without a result")

    async def astream(self, request, max_tokens: int = 64, temperature: float = 0.0,
                      policy: str | None = None, stop: list[str] | None = None) -> AsyncIterator[str]:
        async for ev in self.astream_events(request, max_tokens, temperature, policy, stop):
            if isinstance(ev, Delta):
                yield ev.text

    def shutdown(self) -> None:
        self.runtime.shutdown()


@dataclass
class _Run:
    """One submitted request: accumulates its deltas, checks the link outcome, builds the Generation."""

    engine: EpicEngine
    req_id: str
    prompt: _Prompt
    pol: Policy
    job: LinkJob | None
    t0: float
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    t_first: float | None = None
    finish: str | None = None
    cached: int | None = None

    def feed(self, d: Delta | BaseException) -> bool:
        """Take one delta; True when the request finished. Raises the engine's error, or a link failure
        before any token of a wrongly linked answer is passed on."""
        if isinstance(d, BaseException):
            raise d
        if d.token_ids and self.t_first is None:
            self.t_first, self.cached = d.t, d.cached_tokens
            if self.job is not None and self.job.error:
                raise RuntimeError(f"linking failed, answer discarded: {self.job.error}")
        self.text.append(d.text)
        self.token_ids += d.token_ids
        if d.finished:
            self.finish = d.finish_reason
        return d.finished

    def cancel(self) -> None:
        self.engine.runtime.abort(self.req_id)
        if self.job is not None:
            BOARD.drop_job(self.job.job_id)

    def result(self) -> Generation:
        n, job = len(self.prompt.token_ids), self.job
        if job is not None:
            BOARD.drop_job(job.job_id)
            if job.error:
                raise RuntimeError(f"linking failed, answer discarded: {job.error}")
            recomputed = job.recomputed + (n - len(job.token_ids))
        else:
            recomputed = n - (self.cached or 0)   # `prefix`: vLLM's own prefix-cache hits are not recomputed
        now = time.perf_counter()
        return Generation(text="".join(self.text), token_ids=self.token_ids, ttft_s=(self.t_first or now) - self.t0,
                          total_s=now - self.t0, prompt_tokens=n, linked_tokens=n - recomputed,
                          recomputed_tokens=recomputed, chunk_hits=self.prompt.hits,
                          chunk_misses=self.prompt.misses, policy=self.pol.name, finish_reason=self.finish,
                          chunk_keys=[kv.key for _, kv, exact in self.prompt.spans if not exact],
                          prefix_cached_tokens=0 if job is not None else (self.cached or 0))


def kv_fingerprint(model_fp: str, tokenizer_fp: str, kv_dtype: str) -> str:
    """What a chunk's KV depends on besides its tokens and compile variant."""
    return hashlib.sha256(f"{model_fp}|{tokenizer_fp}|{kv_dtype}".encode()).hexdigest()


def chunk_key(fingerprint: str, token_ids: Sequence[int], variant: str = "plain") -> str:
    h = hashlib.sha256(fingerprint.encode())
    h.update(variant.encode())
    h.update(torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes())
    return f"{variant}-{h.hexdigest()[:40]}"


def _truncate(kv: ChunkKV, n: int) -> ChunkKV:
    if n >= kv.num_tokens:
        return kv
    return ChunkKV(kv.key, kv.token_ids[:n], kv.k[:, :n], kv.v[:, :n], kv.base_pos)


def _event_sink(ev: threading.Event):
    def sink(d):
        if isinstance(d, BaseException):
            ev.error = f"{type(d).__name__}: {d}"  # type: ignore[attr-defined]
            ev.set()
        elif d.finished:
            ev.set()
    return sink
