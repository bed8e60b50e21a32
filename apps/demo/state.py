"""What the demo's routes share: its config, the engine (None while it loads), the document library, metrics
and admission."""

from __future__ import annotations

import concurrent.futures
import time

from fastapi import HTTPException

from .admission import Admission
from .config import PAGE_POLICIES, DemoConfig
from .library import Library, private_dir
from .metrics import DemoMetrics


class DemoState:
    """What the routes share: config, engine (None while it loads), library, metrics."""

    def __init__(self, config: DemoConfig, encoder=None) -> None:
        self.cfg = config
        self.engine = None
        private_dir(config.data_dir)  # the demo's data (KV, uploads, embeddings) is its owner's only
        self.library = Library(config, encoder)
        self.metrics = DemoMetrics(lambda: self.engine, self.library, frozenset(PAGE_POLICIES) | {config.policy})
        self.admission = Admission(config.max_inflight, config.max_queued)
        self.uploads = 0  # upload requests being received, waiting or parsed (LimitsAndMetrics admits them)
        self.started = time.time()
        self.active_chats = 0  # chat completions in flight (ingestion yields to them)
        self.library.busy = lambda: self.active_chats > 0
        # Uploads wait on their parser process here, not in the default pool that chat requests need.
        self.upload_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="epic-demo-upload")

    def not_ready(self) -> str | None:
        """None when a chat completion can be served now; otherwise why not (loading, engine dead)."""
        if self.engine is None:
            return "the engine is still loading"
        runtime = getattr(self.engine, "runtime", None)
        return runtime.health() if runtime is not None else None

    def ready_engine(self):
        """The engine, for a route that needs it now; 503 while it loads or after its thread died."""
        if self.engine is None:
            raise HTTPException(
                503, "the engine is still loading; retry in a few seconds", headers={"Retry-After": "5"}
            )
        if self.not_ready():  # the engine thread died: restart the server
            raise HTTPException(503, "the engine is not running; the server needs a restart")
        return self.engine

    def attach_engine(self, engine) -> None:
        """Hand over a ready engine: the corpus starts loading in the background."""
        self.engine = engine
        self.library.start(engine)
