"""DemoConfig: what the demo server runs (corpus, store, limits), and opening its chunk store."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from epic_rag.models import DEMO_MODEL
from epic_rag.paths import cache_dir
from epic_rag.policy import DEFAULT_POLICY, parse_policy
from epic_rag.redact import redact

log = logging.getLogger(__name__)

# The default link policy (each request may pick another) is the engine's, DEFAULT_POLICY ("auto"): legolink-16
# once a request's chunks are refined behind their neighbours (the library does so after compiling), else
# query-20 (docs/benchmarks.md). The policy switch in the page (the API accepts any name parse_policy accepts).
PAGE_POLICIES = [
    "auto",
    "query-20",
    "query-15",
    "legolink-16",
    "legolink-0",
    "naive",
    "cacheblend-15",
    "full",
    "prefix",
]


def default_data_dir() -> Path:
    return cache_dir() / "demo"


@dataclass(slots=True)
class DemoConfig:
    corpus: str = "builtin:pydoc"  # builtin:pydoc, builtin:pydoc:<mod>,<mod>..., or a folder
    data_dir: Path = field(default_factory=default_data_dir)
    store: str | None = None  # chunk store spec; None: memory over a disk tier under data_dir
    policy: str = DEFAULT_POLICY  # default link policy (each request may pick another)
    model: str = DEMO_MODEL  # a coder model for the default corpus (Python's docs); SmolLM2 by --model
    api_key: str | None = None  # when set, every route that does work needs it
    host: str = "127.0.0.1"  # the address bound (without a key, only it and localhost are valid Host names)
    allowed_hosts: tuple[str, ...] = ()  # more Host names to serve without a key ("*": any)
    allowed_origins: tuple[str, ...] = ()  # other sites that may send state-changing requests ("*": any)
    top_k: int = 4
    max_top_k: int = 16
    chunk_tokens: int = 256
    compile_batch: int = 4  # chunks per engine.compile call (small: a chat waits for at most one)
    # Neighbour-aware compile (EpicEngine.refine): once the corpus is compiled, each chunk is compiled again
    # behind this many of its nearest chunks by the FAISS index, and links use that record; 0 turns it off.
    refine_neighbours: int = 2
    default_max_tokens: int = 128
    max_tokens_limit: int = 1024
    max_prompt_chars: int = 8000  # all message text of one request together
    max_messages: int = 64
    history_messages: int = 6  # earlier turns folded into the question as context
    max_body_bytes: int = 1 << 20  # JSON bodies
    max_upload_bytes: int = 10 << 20  # one uploaded document
    max_upload_inflight: int = 2  # uploads being received or parsed at once (each parse is a CPU-limited process)
    max_upload_queued: int = 4  # more waiting for a parser; beyond that 429 + Retry-After, body unread
    max_documents: int = 1000  # uploaded documents kept (beyond that an upload is refused: 507)
    max_upload_total_bytes: int = 1 << 30  # bytes of uploaded documents kept, together
    max_embedding_cache_bytes: int = 1 << 30  # the on-disk embedding cache stops growing here
    max_model_len: int = 8192
    multiprocess: bool = False  # vLLM's engine core in its own process (EngineConfig.multiprocess)
    max_inflight: int = 16  # chat completions generating at once
    max_queued: int = 64  # more waiting for a slot; beyond that 429 + Retry-After
    parse_cpu_s: int = 20  # CPU seconds one HTML/PDF extraction may use (in its worker process)
    max_document_chars: int = 10 << 20  # characters per document after decoding/extraction
    disk_max_bytes: int = 20 << 30  # budget of the default disk tier (least recently used entries evicted)
    stream_write_timeout_s: float = 30.0  # a streamed response whose client takes longer to take a write is dropped
    stream_keepalive_s: float = 15.0  # an SSE comment is sent when the engine has said nothing for this long
    stream_idle_s: float = 300.0  # a stream with no engine output for this long ends with an error (and is aborted)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).expanduser()
        parse_policy(self.policy)
        for name in (
            "top_k",
            "max_top_k",
            "chunk_tokens",
            "compile_batch",
            "refine_neighbours",
            "default_max_tokens",
            "max_tokens_limit",
            "max_prompt_chars",
            "max_messages",
            "max_body_bytes",
            "max_upload_bytes",
            "max_upload_inflight",
            "max_upload_queued",
            "max_documents",
            "max_upload_total_bytes",
            "max_embedding_cache_bytes",
            "parse_cpu_s",
            "max_inflight",
            "max_queued",
            "max_document_chars",
            "disk_max_bytes",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name in ("top_k", "refine_neighbours") else 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("stream_write_timeout_s", "stream_keepalive_s", "stream_idle_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if self.top_k > self.max_top_k:
            raise ValueError(f"top_k ({self.top_k}) exceeds max_top_k ({self.max_top_k})")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens exceeds max_tokens_limit")
        if self.api_key is not None and not self.api_key:
            self.api_key = None

    @property
    def store_spec(self) -> str:
        """Default: a 2 GiB memory tier over a disk tier with a byte budget (`disk_max_bytes`, least recently
        used entries evicted beyond it), so a restart reuses compiled chunks and clients cannot fill the disk."""
        return self.store or f"memory?max_bytes=2G+disk:{self.data_dir / 'kv'}?max_bytes={self.disk_max_bytes}"

    @property
    def corpus_dir(self) -> Path | None:
        """The corpus folder when the corpus is one (uploads are saved there), else None."""
        if self.corpus.startswith("builtin:"):
            return None
        return Path(self.corpus).expanduser().resolve()

    @property
    def uploads_dir(self) -> Path:
        return self.corpus_dir or (self.data_dir / "uploads")

    @property
    def served_model(self) -> str:
        """The model id /v1/models reports (a packaged name, or a model folder's name)."""
        return Path(self.model).name if os.sep in self.model else self.model


def demo_store_spec(spec: str) -> str:
    """The spec to hand an engine whose core opens the store in its own process: `spec` when it opens here,
    else "memory" (with open_demo_store's warning)."""
    from epic_rag.store import open_store

    try:
        open_store(spec).close()
        return spec
    except _STORE_ERRORS as e:
        _fell_back(spec, e)
        return "memory"


def open_demo_store(spec: str):
    """Open the chunk store; a spec the store layer rejects falls back to memory with a warning."""
    from epic_rag.store import open_store

    try:
        return open_store(spec)
    except _STORE_ERRORS as e:
        _fell_back(spec, e)
        return open_store("memory")


_STORE_ERRORS = (ValueError, OSError, ImportError, ConnectionError)


def _fell_back(spec: str, e: Exception) -> None:
    log.warning(  # redacted: a Redis spec may carry its password
        "chunk store %r is not available (%s); using the memory store instead, so compiled "
        "chunks will not survive a restart",
        redact(spec),
        redact(e),
    )
