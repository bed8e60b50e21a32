"""EpicEngine: compile chunks once, link them in any order, generate (sync, streaming, async)."""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence

from typing_extensions import Unpack

from ..config import EngineConfig
from ..keys import kv_fingerprint, record_key
from ..matching import ChunkTextIndex
from ..models import model_fingerprint, resolve_model, tokenizer_fingerprint
from ..policy import AUTO_ESCALATED, AUTO_PLAIN, AUTO_REFINED, SINK_LEN, parse_policy
from ..prompt import assemble, compile_lead, compile_lead_behind, encode_glue, render_messages, to_segments
from ..sampling import check_sampling_options
from ..store import ChunkKV, ChunkStore, open_shared_tiers, open_store
from ..store.checked import KeyCheckedStore
from ..types import ChunkRef, Delta, Generation, PreparedRequest, RagRequest, Sampling, Segment
from . import guard, vllm_api
from .chunks import ChunkResolver
from .connector.tenancy import shared_salt, unique_salt
from .jobs import LinkRequest
from .link.memory import gpu_memory_share, workspace_tokens
from .ordering import order_request
from .request import LinkFailed, RequestRun, last_generation
from .runtime import EMPTY, POLL_S, STALL_S, Runtime, next_item
from .stores import ChunkStores, new_glue_store, register_local, unregister_local

Request = RagRequest | str | Sequence[Segment] | PreparedRequest
LINK_RETRIES = 1  # a request whose link failed is run again once, after its chunks were checked
log = logging.getLogger(__name__)


class EpicEngine:
    """An embedded vLLM engine with position-independent chunk caching (EPIC's compile + link)."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        try:
            self._build(config or EngineConfig())
        except BaseException:  # Ctrl-C while the model loads, a failed check: what was built is torn down
            self.shutdown()
            raise

    def _build(self, config: EngineConfig) -> None:
        self.config = config
        self.default_policy = parse_policy(config.policy)
        self.model_dir = resolve_model(config.model)
        # With the core in its own process, or workers in their own (tensor parallelism), they open the store
        # from its spec there; this process keeps its own look-ups to the shared tiers.
        remote = config.multiprocess or config.tensor_parallel_size > 1
        if remote and not isinstance(config.store, str):
            raise ValueError(
                "multiprocess=True and tensor_parallel_size > 1 need a store spec string: the workers open it"
            )
        # The worker links from and compiles into these (stores.py): the same objects when vLLM's engine
        # core runs in this process, its own stores opened from the spec when it runs in its own; then this
        # process only looks entries up in the shared tiers, keeping no copies.
        store = open_shared_tiers(config.store) if remote else open_store(config.store)
        stores = ChunkStores(store, new_glue_store())
        self._local = None if remote else register_local(stores)
        extra = {"store": config.store} if remote else {"local": self._local}
        extra["max_compile_tokens"] = None  # the engine's own compiles (its chunks), not a client's: no bound
        self.dtype = vllm_api.prepare_process(config)
        ws = workspace_tokens(config.link_workspace_tokens, config.max_model_len)
        share = gpu_memory_share(config, str(self.model_dir), self.dtype, ws)
        self._llm = vllm_api.new_llm_engine(str(self.model_dir), self.dtype, config, extra, ws, share)
        infos = self._llm.collective_rpc("epic_attach")  # one per tensor-parallel rank
        self.kv_info = infos[0]
        self.tokenizer = self._llm.get_tokenizer()
        self.max_model_len = config.max_model_len
        self.text_index = ChunkTextIndex()  # compiled chunk texts, found again inside rendered prompts
        self.runtime = Runtime(self._llm, heap_trim_s=config.heap_trim_s)
        fp = kv_fingerprint(
            model_fingerprint(self.model_dir), tokenizer_fingerprint(self.tokenizer), self.kv_info["kv_dtype"]
        )
        if any(
            fp != info["fingerprint"] for info in infos
        ):  # keys made here must name what the worker stores and reads
            self.shutdown()
            raise RuntimeError("the engine's and the worker's model/tokenizer fingerprints differ")
        lead = compile_lead(self.tokenizer, config.compile_lead)
        self.chunks = ChunkResolver(
            stores,
            self.runtime,
            self.tokenizer,
            fp,
            self.kv_info,
            self.max_model_len,
            lead,
            lead_behind=lambda near: compile_lead_behind(self.tokenizer, near, config.compile_lead),
        )
        self.store = store  # read through the key check (see the setter)
        stores.glue = KeyCheckedStore(stores.glue, self._entry_key)
        self.runtime.start()

    @property
    def store(self) -> ChunkStore:
        """The chunk store compiled KV is read from and written to (may be swapped for another)."""
        store = self.chunks.store
        return store.inner if isinstance(store, KeyCheckedStore) else store

    @store.setter
    def store(self, store: ChunkStore) -> None:
        # Every entry the engine reads must hold the tokens its key was computed from (store/checked.py).
        self.chunks.store = KeyCheckedStore(store, self._entry_key)

    def _entry_key(self, kv: ChunkKV) -> str | None:
        """The key `kv` is stored under when it is this engine's: the one its own tenant, lead and tokens hash
        to (keys.record_key; a tensor-parallel rank's record keeps its rank suffix); None for another
        tenant's record."""
        return record_key(self.chunks.fingerprint, kv) if kv.tenant == self.chunks.tenant_id else None

    # ------------------------------------------------------------------ compile
    def chunk_key(self, token_ids: Sequence[int], variant: str | None = None) -> str:
        """Content-derived key (model, tokenizer and KV dtype fingerprint, compile variant, tokens): by default
        the key `compile` stores a chunk of these tokens under."""
        return self.chunks.key(token_ids, variant or self.chunks.variant)

    def compile(self, chunks: Sequence[str], policy: str | None = None, batch_size: int = 32) -> list[ChunkRef]:
        """Compile chunk texts (skipping those already stored), `batch_size` per vLLM batch; returns refs in
        input order. One compiled form serves every policy; `policy` is only checked."""
        if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Iterable):
            raise ValueError(f"compile takes a list of chunk texts, got {type(chunks).__name__}")
        if policy is not None:
            parse_policy(policy)
        refs = self.chunks.compile(list(chunks), batch_size)
        for r in refs:
            self.text_index.add(r)
        return refs

    def refine(self, chunks: Sequence[str], neighbours: Sequence[Sequence[str]], batch_size: int = 8) -> list[ChunkRef]:
        """Neighbour-aware compile: compile each chunk text again behind its neighbours' texts (in prompt order,
        the nearest last; each a document of the template before it) and link that chunk in this form from
        now on (chunks.py). Its KV has seen records like it, which a chunk compiled alone never has (lookups
        among look-alike records). The record is keyed by its neighbour set, never the chunk's plain record.
        Returns refs to the refined records, in input order."""
        if isinstance(chunks, (str, bytes)) or len(chunks) != len(neighbours):
            raise ValueError("refine takes a list of chunk texts and one list of neighbour texts per chunk")
        toks = [self.chunks.chunk_tokens(t) for t in chunks]
        near = [[self.chunks.chunk_tokens(t) for t in ns] for ns in neighbours]
        self.compile(list(chunks))  # the plain records stay what links fall back to
        keys = self.chunks.refine(toks, near, batch_size)
        return [ChunkRef(k, len(t), text) for k, t, text in zip(keys, toks, chunks)]

    def refine_nearest(self, chunks: Sequence[str], k: int = 2, embeddings=None, batch_size: int = 8) -> list[ChunkRef]:
        """`refine` with each chunk's `k` nearest neighbours among `chunks`, by cosine similarity of
        `embeddings` (one vector per chunk: the retriever's own) or of the packaged MiniLM's."""
        import numpy as np

        texts = list(chunks)
        if k < 1 or len(texts) < 2:
            raise ValueError("refine_nearest needs k >= 1 and at least two chunks")
        if embeddings is None:
            from ..embeddings import sentence_encoder

            embeddings = sentence_encoder().encode(texts, normalize_embeddings=True, show_progress_bar=False)
        emb = np.asarray(embeddings, dtype=np.float32)  # [N, E]
        if emb.shape[0] != len(texts):
            raise ValueError(f"refine_nearest: {emb.shape[0]} embeddings for {len(texts)} chunks")
        emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        k = min(k, len(texts) - 1)
        near = []
        for lo in range(0, len(texts), 1024):  # a block of rows at a time: never an [N, N] matrix
            sims = emb[lo : lo + 1024] @ emb.T  # [B, N]
            sims[np.arange(sims.shape[0]), np.arange(lo, lo + sims.shape[0])] = -np.inf
            top = np.argpartition(-sims, k - 1, axis=1)[:, :k]  # [B, k], unordered
            for row, idx in zip(sims, top):
                near.append(idx[np.argsort(-row[idx], kind="stable")][::-1])  # the nearest last, next to the chunk
        return self.refine(texts, [[texts[j] for j in idx] for idx in near], batch_size)

    def unrefine(self, chunks: Sequence[str]) -> int:
        """Undo `refine` for these chunk texts: links use their plain records again (a neighbour set that
        no longer holds, a corpus changed). Returns how many chunks had a refined form."""
        if isinstance(chunks, (str, bytes)):
            raise ValueError("unrefine takes a list of chunk texts")
        return self.chunks.unrefine([self.chunks.chunk_tokens(t) for t in chunks])

    # ------------------------------------------------------------------ prompts
    def render_messages(self, messages: Sequence[dict]) -> list[Segment]:
        """Chat-template role/content messages (generation prompt added); compiled chunk texts found in
        them become ChunkRef segments, the rest of their text is tokenized as plain text (prompt.py)."""
        return render_messages(self.tokenizer, self.text_index, messages)

    def prepare(
        self,
        request: Request,
        max_tokens: int = 64,
        temperature: float = 0.0,
        policy: str | None = None,
        stop: list[str] | None = None,
        order: str = "given",
        **options,
    ) -> PreparedRequest:
        """Validate and tokenize a request once (no chunk is compiled or loaded yet). Raises ValueError for
        bad input, e.g. a prompt that does not fit the context window, or an unknown sampling option.
        `options`: top_p, top_k, min_p, seed, presence_penalty, frequency_penalty, repetition_penalty,
        logprobs, response_format, min_tokens, ignore_eos, skip_special_tokens (see Sampling). `order`: a
        RagRequest's chunks as given, or by relevance (ordering.py). A PreparedRequest is returned as is."""
        if isinstance(request, PreparedRequest):
            return request
        options = check_sampling_options(options)
        pol = parse_policy(policy) if policy is not None else self.default_policy
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if not isinstance(temperature, (int, float)) or not 0.0 <= float(temperature) <= 2.0:  # vLLM's range
            raise ValueError(f"temperature must be a number in [0, 2], got {temperature!r}")
        if (
            stop is not None
            and not isinstance(stop, str)
            and (not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop))
        ):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        request, chunk_order = order_request(request, order)
        segments = to_segments(self.tokenizer, self.text_index, request)
        sink = [self.chunks.sink_token] * SINK_LEN if pol.keeps_sink else []
        prompt = assemble(
            segments, lambda s: encode_glue(self.tokenizer, s), self.chunks.place, self.max_model_len, sink
        )
        escalated = None
        if pol.kind == "auto":  # every choice drops the sink: the prompt assembled above is theirs
            question = guard.question_text(request, segments)
            verdict = guard.check(question, (self.tokenizer.decode(c.token_ids) for c in prompt.chunks))
            if verdict.escalate:
                escalated = verdict.reason
                log.info("auto: escalated to %s (%s: %s)", AUTO_ESCALATED, escalated, guard.describe(verdict))
                pol = parse_policy(AUTO_ESCALATED)
            else:
                refined = bool(prompt.chunks) and all(self.chunks.is_refined(c.token_ids) for c in prompt.chunks)
                pol = parse_policy(AUTO_REFINED if refined else AUTO_PLAIN)
        return PreparedRequest(
            prompt.token_ids,
            prompt.chunks,
            pol,
            min(max_tokens, self.max_model_len - len(prompt.token_ids)),
            float(temperature),
            [stop] if isinstance(stop, str) else stop,
            options,
            chunk_order,
            escalated,
        )

    # ------------------------------------------------------------------ generation
    def _start(self, request: Request, sink, **sampling: Unpack[Sampling]) -> RequestRun:
        """Prepare, make sure every chunk is stored (compiling misses) and submit with the link job."""
        t0 = time.perf_counter()
        if isinstance(request, PreparedRequest) and sampling:  # never dropped silently
            raise ValueError(f"{', '.join(sampling)}: give these to prepare(); a PreparedRequest already has them")
        prep = self.prepare(request, **sampling)
        pol, link, kv_params, hits, misses, keys = prep.policy, None, None, 0, 0, []
        if pol.links_chunks and prep.chunks:
            spans, misses = self.chunks.link_spans(prep.token_ids, prep.chunks, pol)
            hits, keys = len(prep.chunks) - misses, [s.key for s in spans if not s.exact]
            link = LinkRequest(pol, self.chunks.sink_token, tuple(spans), on_missing="fail")
            kv_params = link.to_params()
        # One salt for the tenant's requests: vLLM's prefix cache serves exact blocks (the template before the
        # first chunk, a `prefix` repeat) and a link's blocks only to a request linking the same chunks the same
        # way (connector/scheduler.py on_new_request); `full` reuses nothing (the baseline).
        options = dict(prep.options)
        salt = options.pop("cache_salt", None)
        tenant = self.chunks.tenant
        salt = unique_salt(tenant) if pol.kind == "full" else shared_salt(tenant, salt or "shared")
        req_id = self.runtime.submit_tokens(
            prep.token_ids,
            sink,
            max_tokens=prep.max_tokens,
            temperature=prep.temperature,
            salt=salt,
            kv_params=kv_params,
            stop=prep.stop,
            **options,
        )
        return RequestRun(self.runtime, req_id, prep, link, t0, hits, misses, keys, on_missing=self.chunks.forget)

    def stream_events(self, request: Request, **sampling: Unpack[Sampling]) -> Iterator[Delta | Generation]:
        """Yield each text delta as it is produced, then the final Generation. A request whose link failed
        (before any token) is run once more after its chunks were checked and, where needed, recompiled."""
        for attempt in range(1 + LINK_RETRIES):
            box: queue.SimpleQueue = queue.SimpleQueue()
            run = self._start(request, box.put, **sampling)
            try:
                while not run.done:
                    yield from run.consume(self.runtime.poll(lambda t: box.get(timeout=t)))
                return
            except LinkFailed:
                if attempt == LINK_RETRIES:
                    raise
                self._recheck(run)
            except BaseException:  # includes GeneratorExit: the consumer went away
                run.cancel()
                raise

    def _recheck(self, run: RequestRun) -> None:
        """After a failed link: its records are read and checked again before the retry (the worker logged
        which it did not find: evicted, damaged, or misfiled ones are recompiled then)."""
        log.warning("request %s: its link failed; checking its chunks and retrying once", run.req_id)
        self.chunks.forget([s.key for s in run.link.spans])

    async def astream_events(self, request: Request, **sampling: Unpack[Sampling]):
        """Async form of stream_events: deltas, then the Generation. Cancelling aborts the request."""
        for attempt in range(1 + LINK_RETRIES):
            try:
                async for ev in self._astream_once(request, **sampling):
                    yield ev
                return
            except LinkFailed as e:
                if attempt == LINK_RETRIES:
                    raise
                self._recheck(e.run)

    async def _astream_once(self, request: Request, **sampling: Unpack[Sampling]):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def sink(d):
            loop.call_soon_threadsafe(q.put_nowait, d)

        # Setup may compile chunks (blocking): run it off the event loop. If the caller is cancelled
        # meanwhile, the request that setup submits is aborted as soon as it exists.
        setup = asyncio.ensure_future(asyncio.to_thread(self._start, request, sink, **sampling))
        try:
            run = await asyncio.shield(setup)
        except asyncio.CancelledError:
            setup.add_done_callback(lambda f: None if f.cancelled() or f.exception() else f.result().cancel())
            raise
        try:
            stalled = 0.0
            while not run.done:
                item = await next_item(q, POLL_S)
                if item is EMPTY:  # the engine's health is checked while waiting, as in stream_events
                    stalled += POLL_S
                    if (why := self.runtime.health()) is not None:
                        raise RuntimeError(why) from None
                    if stalled > STALL_S:
                        raise TimeoutError(f"no output from the engine for {STALL_S:g} s") from None
                    continue
                stalled = 0.0
                for ev in run.consume(item):
                    yield ev
        except LinkFailed:
            raise
        except BaseException:  # includes cancellation: the client went away
            run.cancel()
            raise

    def generate(self, request: Request, **sampling: Unpack[Sampling]) -> Generation:
        """Answer one request. Keywords (Sampling): max_tokens (64), temperature (0.0: greedy), policy (the
        engine's default), stop, and vLLM's top_p, top_k, min_p, seed, presence_penalty, frequency_penalty,
        repetition_penalty, logprobs; the same for every generate/stream method."""
        return last_generation(self.stream_events(request, **sampling))

    def stream(self, request: Request, **sampling: Unpack[Sampling]) -> Iterator[str]:
        """Yield text deltas."""
        for ev in self.stream_events(request, **sampling):
            if isinstance(ev, Delta):
                yield ev.text

    async def agenerate(self, request: Request, **sampling: Unpack[Sampling]) -> Generation:
        async for ev in self.astream_events(request, **sampling):
            if isinstance(ev, Generation):
                return ev
        raise RuntimeError("generation ended without a result")

    async def astream(self, request: Request, **sampling: Unpack[Sampling]) -> AsyncIterator[str]:
        async for ev in self.astream_events(request, **sampling):
            if isinstance(ev, Delta):
                yield ev.text

    def shutdown(self) -> None:
        """Stop in order (any time, also half way through __init__; idempotent): the stepping thread ends its
        step and fails what still waits, then vLLM's engine core is torn down (executor and workers, or its
        process) here, not by finalizers at interpreter exit, where a native thread still running aborts the
        process ("terminate called without an active exception")."""
        runtime = getattr(self, "runtime", None)
        stopped = runtime.shutdown() if runtime is not None else True
        llm = getattr(self, "_llm", None)
        if llm is not None and stopped:  # a step still running would use what this frees
            vllm_api.shutdown_engine(llm)
        elif llm is not None:
            log.error("the engine thread is still inside a step; vLLM's engine is left to exit with the process")
        if getattr(self, "_local", None) is not None:
            unregister_local(self._local)
            self._local = None
