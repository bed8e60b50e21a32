"""`epic-rag demo`: the chat server over a document corpus (runs with no arguments)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger("epic_rag_demo")


def register(subparsers) -> None:
    from epic_rag.models import DEMO_MODEL

    from .config import DEFAULT_POLICY

    d = subparsers.add_parser(
        "demo",
        help="chat server over documents with an OpenAI-compatible API",
        description="Serve a chat page and an OpenAI-compatible API over a document corpus "
        "(default: Python's pydoc text, Qwen2.5-Coder-0.5B-Instruct, FAISS retrieval, a disk chunk store).",
    )
    d.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    d.add_argument("--port", type=int, default=8000)
    d.add_argument(
        "--corpus",
        default="builtin:pydoc",
        help="folder of .txt/.md/.pdf/.html documents (uploads are saved there), or builtin:pydoc",
    )
    d.add_argument(
        "--store",
        default=None,
        help="chunk store spec (default memory?max_bytes=2G+disk:<data-dir>/kv?max_bytes=20G, so a restart "
        "reuses compiled chunks; memory+redis://HOST:6379/0 shares them between replicas)",
    )
    d.add_argument(
        "--policy", default=DEFAULT_POLICY, help="default link policy (the page can switch; default %(default)s)"
    )
    d.add_argument(
        "--api-key",
        default=None,
        help="require this key (Authorization: Bearer KEY); default: $EPIC_RAG_API_KEY, else none",
    )
    d.add_argument(
        "--insecure-no-key",
        action="store_true",
        help="allow a non-loopback --host without an API key (anyone who can reach it can use it)",
    )
    d.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated Host names served without a key besides the bound address and localhost "
        "(default none: a DNS-rebinding page cannot reach the server; '*' allows any)",
    )
    d.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated origins (https://app.example) allowed to send uploads, deletes and chats "
        "besides the page itself (default none: no other website can; '*' allows any)",
    )
    d.add_argument(
        "--model", default=DEMO_MODEL, help=f"packaged name, model folder or Hugging Face id (default {DEMO_MODEL})"
    )
    d.add_argument("--data-dir", default=None, help="default ~/.cache/epic_rag/demo")
    d.add_argument("--top-k", type=int, default=4)
    d.add_argument("--chunk-tokens", type=int, default=256)
    d.add_argument(
        "--refine-neighbours",
        type=int,
        default=2,
        help="once the corpus is compiled, compile each chunk again behind this many nearest chunks (by the "
        "search index) and link that record (neighbour-aware compile; 0: off; default 2)",
    )
    d.add_argument("--max-model-len", type=int, default=8192)
    d.add_argument(
        "--multiprocess",
        action="store_true",
        help="run vLLM's engine core (and the linker) in its own process, as `vllm serve` does",
    )
    d.add_argument(
        "--no-browser-needed",
        action="store_true",
        help="do not open the page in a web browser (servers, CI, API-only use)",
    )
    d.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    d.set_defaults(func=cmd_demo)


def _config(args):
    from .config import DemoConfig, default_data_dir

    if args.corpus != "builtin:pydoc" and not args.corpus.startswith("builtin:"):
        p = Path(args.corpus).expanduser()
        if not p.is_dir():
            raise ValueError(f"--corpus {args.corpus}: not a folder")
    return DemoConfig(
        corpus=args.corpus,
        data_dir=Path(args.data_dir) if args.data_dir else default_data_dir(),
        store=args.store,
        policy=args.policy,
        model=args.model,
        api_key=args.api_key or os.environ.get("EPIC_RAG_API_KEY") or None,
        host=args.host,
        allowed_hosts=_csv(args.allowed_hosts),
        allowed_origins=_csv(args.allowed_origins),
        top_k=args.top_k,
        chunk_tokens=args.chunk_tokens,
        refine_neighbours=args.refine_neighbours,
        max_model_len=args.max_model_len,
        multiprocess=args.multiprocess,
    )


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _progress_bars(library):
    """tqdm bars on stderr that follow the library's ingestion progress."""
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def update(p) -> None:
        for name, done in (("embedded", p.embedded), ("compiled", p.compiled)):
            bar = bars.get(name)
            if bar is None:
                bar = bars[name] = tqdm(
                    total=max(p.chunks, 1),
                    desc=f"chunks {name}",
                    unit="chunk",
                    position=len(bars),
                    leave=True,
                    dynamic_ncols=True,
                )
            bar.total = max(p.chunks, 1)
            bar.n = done
            bar.refresh()

    return update


def cmd_demo(args: argparse.Namespace) -> int:
    logging.getLogger("epic_rag_demo").setLevel(args.log_level.upper())
    cfg = _config(args)
    from .access import check_bind

    try:
        check_bind(args.host, cfg.api_key, args.insecure_no_key)
    except ValueError as e:
        print(f"epic-rag demo: {e}", file=sys.stderr)
        return 2

    from epic_rag.stopping import StopSignals

    from .background import BackgroundServer
    from .server import create_app

    app = create_app(engine=None, config=cfg)
    state = app.state.demo
    server = None
    # Ctrl-C and SIGTERM at any moment (loading, ingest, compile, an answer) end in _stop: in order, exit 130 / 0
    with StopSignals() as signals:
        try:
            # Serve at once (/healthz answers "loading"); the engine loads on this thread (vLLM wants the main one).
            server = BackgroundServer(
                app, args.host, args.port, log_level=args.log_level, access_log=args.log_level == "debug"
            )
            server.start()
            _serve(args, cfg, server, state)
        except KeyboardInterrupt:
            print("\nstopping", file=sys.stderr)
        finally:
            _stop(server, state)
    return signals.exit_code


def _serve(args, cfg, server, state) -> None:
    """Load the engine, hand it to the app, and wait for the server to end (or a stop signal)."""
    from epic_rag import EngineConfig, EpicEngine

    from .config import demo_store_spec, open_demo_store

    auth = "API key required" if cfg.api_key else "no API key"
    print(f"epic-rag demo: {server.url}  ({auth}; corpus {cfg.corpus}; data {cfg.data_dir})", file=sys.stderr)
    if not cfg.api_key and args.insecure_no_key:
        log.warning("listening on %s without an API key: anyone who can reach it can use it", args.host)
    t0 = time.perf_counter()
    # with the engine core in its own process, that process opens the store from its spec
    store = demo_store_spec(cfg.store_spec) if cfg.multiprocess else open_demo_store(cfg.store_spec)
    config = EngineConfig(
        model=cfg.model, policy=cfg.policy, store=store, max_model_len=cfg.max_model_len, multiprocess=cfg.multiprocess
    )
    # held by the state at once: _stop tears it down whatever happens next (a half-built one tears itself down)
    state.engine = engine = EpicEngine(config)
    print(
        f"engine ready in {time.perf_counter() - t0:.1f}s (store {type(engine.store).__name__}); "
        "ingesting the corpus in the background",
        file=sys.stderr,
    )
    state.library.listeners.append(_progress_bars(state.library))
    state.attach_engine(engine)
    if (
        not args.no_browser_needed
        and sys.stdout.isatty()
        and (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or sys.platform == "darwin")
    ):
        import webbrowser

        webbrowser.open(server.url)
    while server.thread.is_alive():
        server.thread.join(1.0)


def _stop(server, state) -> None:
    """Tear down in order: no new HTTP work; ingestion takes no more; the engine ends its step and fails what
    still waits (compiles and answers in flight end with an error, nothing half stored), then its core goes;
    the ingestion thread and the server are joined. Nothing is left running into interpreter exit."""
    if server is not None:
        server.server.should_exit = True  # stop accepting; answers in flight end when the engine stops
    state.library.stop(timeout=0)
    if state.engine is not None:
        state.engine.shutdown()
    state.library.stop(timeout=120)  # its compile failed at once; an embedding batch in flight ends first
    if server is not None:
        server.stop()
