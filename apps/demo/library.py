"""The demo's document library: documents -> chunks -> FAISS index (retrieval) + compiled chunk KV.

One background thread does all ingestion (chunking, embedding, engine.compile in batches), so the
server answers while a corpus loads. Chunks become searchable once embedded; until a chunk is compiled
a question that retrieves it passes its text and the engine compiles it on the fly. Once nothing is left to
compile, the same thread refines (neighbour-aware compile, `refine_neighbours`): each chunk compiled again
behind its nearest chunks by the FAISS index, which links of it use from then on.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from epic_rag.corpus import DOC_SUFFIXES, Document, ParseLimits, chunk_document, pydoc_documents, read_document
from epic_rag.embeddings import index_neighbours
from epic_rag.types import ChunkRef

from .config import DemoConfig
from .embedding_cache import EmbeddingCache
from .uploads import (
    UploadManifest,
    check_quota,
    is_upload_name,
    place_upload,
    private_dir,
    safe_upload_name,
)

log = logging.getLogger(__name__)

MAX_ERRORS = 100  # progress errors kept (the oldest go): a long-running server must not grow without bound


class _Stopped(Exception):
    """Raised inside the ingestion thread once the library is stopping: it ends without finishing its step."""


@dataclass(slots=True)
class ChunkRecord:
    id: str  # "<document>#<index>"
    doc: str
    index: int
    text: str
    ref: ChunkRef | None = None  # set once compiled into the store
    failed: bool = False  # compile failed: questions pass the text (compiled on the fly)
    near: tuple[str, ...] | None = None  # the chunks it was refined behind (nearest last); () if it was not


@dataclass(slots=True)
class DocInfo:
    name: str
    source: str  # builtin | corpus | upload
    path: Path | None
    chars: int
    chunks: int = 0
    compiled: int = 0
    state: str = "queued"  # queued | indexing | compiling | ready | error
    error: str | None = None

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            "chars": self.chars,
            "chunks": self.chunks,
            "compiled": self.compiled,
            "state": self.state,
            "error": self.error,
        }


@dataclass(slots=True)
class Progress:
    state: str = "waiting"  # waiting (no engine yet) | loading | indexing | compiling | ready
    documents: int = 0
    chunks: int = 0
    embedded: int = 0
    compiled: int = 0
    compile_seconds: float = 0.0
    refined: int = 0  # chunks linked in their neighbour-aware form
    refine_seconds: float = 0.0
    errors: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_ERRORS))
    started: float = field(default_factory=time.time)

    def as_dict(self) -> dict:
        return {
            "state": self.state,
            "documents": self.documents,
            "chunks": self.chunks,
            "embedded": self.embedded,
            "compiled": self.compiled,
            "compile_seconds": round(self.compile_seconds, 2),
            "refined": self.refined,
            "refine_seconds": round(self.refine_seconds, 2),
            "errors": list(self.errors)[-10:],
            "elapsed_s": round(time.time() - self.started, 1),
        }


class Library:
    """Documents, their chunks, the FAISS index and the ingestion thread. Thread-safe."""

    def __init__(self, config: DemoConfig, encoder=None) -> None:
        self.cfg = config
        self._encoder = encoder
        self.engine = None
        self._lock = threading.RLock()
        self.docs: dict[str, DocInfo] = {}
        self.chunks: dict[str, ChunkRecord] = {}
        self._ids: list[str] = []  # chunk id per index row
        self._index = None  # faiss IndexFlatIP over L2-normalised vectors
        self._tasks: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.progress = Progress()
        self.listeners: list[Callable[[Progress], None]] = []  # called after each step (the CLI's tqdm)
        # True while chats are being answered: compiling waits, so a question asked during ingestion is
        # not decoded in the same engine steps as a batch of chunk prefills.
        self.busy: Callable[[], bool] = lambda: False
        self._emb_cache = EmbeddingCache(config.data_dir, config.max_embedding_cache_bytes)
        self._upload_sizes: dict[str, int] = {}  # uploaded document -> bytes (the quotas)
        # In a corpus folder, which files were uploaded is not in the folder: it is kept here, so the quotas
        # survive a restart (a folder of uploads is all uploads). One per corpus folder.
        self._manifest: UploadManifest | None = None
        if config.corpus_dir is not None:
            self._manifest = UploadManifest(config.data_dir, config.corpus_dir)
            # read now, not when the corpus loads: uploads are taken while the engine still loads
            for name in self._manifest.load():
                p = config.corpus_dir / name
                # a name without its file (deleted, or a crash mid-upload) is dropped; one no upload could have
                # (a path, a hidden name) is not trusted
                if is_upload_name(name) and p.is_file():
                    self._upload_sizes[name] = p.stat().st_size
        self._enc_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        self.parse_limits = ParseLimits(cpu_s=config.parse_cpu_s, max_chars=config.max_document_chars)

    # ------------------------------------------------------------------ lifecycle
    def start(self, engine) -> None:
        """Attach the engine and start ingesting the configured corpus in the background."""
        if self._thread is not None:
            return
        self.engine = engine
        self.progress.state = "loading"
        self._tasks.put(("load",))
        self._thread = threading.Thread(target=self._run, name="epic-demo-ingest", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop ingesting and wait up to `timeout` s for the thread (a compile in flight ends when the engine
        shuts down; an embedding batch in flight first ends)."""
        self._stop.set()
        self._tasks.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)
        if self.engine is not None:  # its neighbour sets end with it: an engine that outlives it links plain
            with self._lock:
                refined = sorted({c.text for c in self.chunks.values() if c.near})
            self.engine.unrefine(refined)

    def wait_ready(self, timeout: float) -> bool:
        """Block until everything queued so far is indexed and compiled (for tests and scripts)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.progress.state == "ready" and self._tasks.empty():
                with self._lock:
                    if all(c.ref is not None or c.failed for c in self.chunks.values()):
                        return True
            time.sleep(0.1)
        return False

    def wait_refined(self, timeout: float) -> bool:
        """Block until every compiled chunk has been refined (or refining is off)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.wait_ready(max(0.0, end - time.monotonic())):
                with self._lock:
                    if self.cfg.refine_neighbours < 1 or len(self.chunks) < 2:
                        return True
                    if all(c.near is not None for c in self.chunks.values() if c.ref is not None):
                        return True
            time.sleep(0.1)
        return False

    @property
    def encoder(self):
        if self._encoder is None:
            from epic_rag.embeddings import sentence_encoder

            self._encoder = sentence_encoder()
        return self._encoder

    # ------------------------------------------------------------------ public operations
    def add_upload(self, filename: str, data: bytes) -> DocInfo:
        """Validate and save an uploaded document, then index and compile it in the background."""
        name = safe_upload_name(filename)
        self._check_quota(name, len(data))  # before any parse or write
        doc = read_document(name, data, self.parse_limits)  # ValueError on anything it cannot read
        folder = self.cfg.uploads_dir
        if self.cfg.corpus_dir is None:
            private_dir(self.cfg.data_dir)
            private_dir(folder)
        else:  # the user's own corpus folder: created owner-only where missing, its mode left as it is
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = (folder / name).resolve()
        if path.parent != folder.resolve():
            raise ValueError("file name resolves outside the upload folder")
        # A unique owner-only (0o600) temp file: concurrent uploads of one name never share it, and its
        # name stays short whatever the upload's name (a dot-name, so a corpus scan skips it).
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".upload-", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            info = DocInfo(name, "upload", path, len(doc.text))
            with self._lock:  # file and index replaced together: the last upload of a name wins in both
                self._check_quota(name, len(data))  # again: concurrent uploads passed the first check together
                # over an earlier upload of this name (a folder of uploads holds nothing else); never a corpus file
                replaces = self.cfg.corpus_dir is None or name in self._upload_sizes
                # recorded before the file lands: a crash in between leaves a name without a file (dropped on
                # load), never an upload counted as the user's own file
                self._save_manifest({**self._upload_sizes, name: len(data)})
                try:
                    place_upload(tmp, path, replaces)
                except BaseException:
                    self._save_manifest(self._upload_sizes)
                    raise
                self._remove_locked(name)
                self._upload_sizes[name] = len(data)
                self.docs[name] = info
                self.progress.documents = len(self.docs)
                self._tasks.put(("add", doc, info))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return info

    def _save_manifest(self, uploads: dict[str, int]) -> None:
        if self._manifest is not None:  # only a corpus folder has one (a folder of uploads is all uploads)
            self._manifest.save(uploads)

    def _check_quota(self, name: str, size: int) -> None:
        with self._lock:  # a consistent view of the uploads (they change under this lock)
            check_quota(self._upload_sizes, name, size, self.cfg)

    def delete(self, name: str) -> DocInfo | None:
        """Drop a document from the index; files in the upload/corpus folder are deleted too."""
        with self._lock:
            info = self._remove_locked(name)
            was_upload = self._upload_sizes.pop(name, None) is not None
            self.progress.documents = len(self.docs)
        if info is not None and info.path is not None:
            folder = self.cfg.uploads_dir.resolve()
            try:
                if info.path.resolve().is_relative_to(folder):
                    info.path.unlink(missing_ok=True)
            except OSError as e:
                log.warning("could not delete %s: %s", info.path, e)
        if was_upload:  # after the file: a crash in between leaves a name without a file (dropped on load)
            with self._lock:
                self._save_manifest(self._upload_sizes)
        return info

    def list_documents(self) -> list[dict]:
        with self._lock:
            return [d.as_dict() for d in sorted(self.docs.values(), key=lambda d: d.name)]

    def status(self) -> dict:
        with self._lock:
            return self.progress.as_dict()

    def get_chunks(self, ids: list[str]) -> tuple[list[ChunkRecord], list[str]]:
        """Records for chunk ids, and the ids not found."""
        with self._lock:
            found = [self.chunks[i] for i in ids if i in self.chunks]
            return found, [i for i in ids if i not in self.chunks]

    def search(self, query: str, k: int) -> list[tuple[ChunkRecord, float]]:
        """Top-k chunks by cosine similarity (best first)."""
        if k <= 0:
            return []
        vec = self._embed([query])
        with self._lock:
            if self._index is None or self._index.ntotal == 0:
                return []
            scores, rows = self._index.search(vec, min(k, self._index.ntotal))
            return [(self.chunks[self._ids[r]], float(s)) for s, r in zip(scores[0], rows[0]) if r >= 0]

    # ------------------------------------------------------------------ ingestion thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_tasks()
                if self._compile_next_batch() or self._refine_next_batch():
                    continue
                with self._lock:
                    self.progress.state = "ready"
                self._notify()
                try:
                    task = self._tasks.get(timeout=0.5)
                except queue.Empty:
                    continue
                self._handle(task)
            except _Stopped:
                return
            except Exception as e:  # keep the thread alive: report (no internals: /api/status shows it) and go on
                if self._stop.is_set():  # the engine shut down under it: stopping, not a failure
                    return
                log.exception("ingestion step failed")
                with self._lock:
                    self.progress.errors.append(f"ingestion step failed ({type(e).__name__}; see the server log)")
                time.sleep(1.0)

    def _drain_tasks(self) -> None:
        while not self._stop.is_set():
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                return
            self._handle(task)

    def _handle(self, task: tuple) -> None:
        if task[0] == "load":
            self._load_corpus()
        elif task[0] == "add":
            self._index_document(task[1], task[2])

    def _load_corpus(self) -> None:
        cfg = self.cfg
        found: list[tuple[Document, str, Path | None]] = []
        if cfg.corpus.startswith("builtin:pydoc"):
            mods = cfg.corpus.removeprefix("builtin:pydoc").lstrip(":")
            docs = pydoc_documents([m.strip() for m in mods.split(",") if m.strip()]) if mods else pydoc_documents()
            found += [(d, "builtin", None) for d in docs]
        elif cfg.corpus.startswith("builtin:"):
            raise ValueError(f"unknown builtin corpus {cfg.corpus!r}; expected builtin:pydoc")
        folder = cfg.uploads_dir
        if folder.is_dir():
            for p in sorted(folder.rglob("*")):
                rel = p.relative_to(folder).as_posix()
                if (
                    not p.is_file()
                    or p.suffix.lower() not in DOC_SUFFIXES
                    or any(part.startswith(".") for part in p.relative_to(folder).parts)
                ):
                    continue
                try:
                    d = read_document(p.name, p.read_bytes(), self.parse_limits)
                except Exception as e:  # one unreadable file is skipped and reported, the corpus loads on
                    log.warning("skipping corpus file %s: %s", rel, e)
                    with self._lock:
                        # a ValueError says what is wrong with the file; anything else may carry paths
                        why = str(e) if isinstance(e, ValueError) else f"{rel}: unreadable ({type(e).__name__})"
                        self.progress.errors.append(f"skipped {why}")
                    continue
                with self._lock:
                    uploaded = cfg.corpus_dir is None or rel in self._upload_sizes
                found.append((Document(rel, d.text), "upload" if uploaded else "corpus", p))
        with self._lock:
            for doc, source, path in found:
                if doc.name not in self.docs:
                    self.docs[doc.name] = DocInfo(doc.name, source, path, len(doc.text))
                    if source == "upload" and path is not None:  # kept uploads count against the quotas
                        self._upload_sizes[doc.name] = path.stat().st_size
            self.progress.documents = len(self.docs)
        for doc, _, _ in found:
            with self._lock:
                info = self.docs.get(doc.name)
            if info is not None and info.state == "queued":
                self._index_document(doc, info)
            if self._stop.is_set():
                return

    def _index_document(self, doc: Document, info: DocInfo) -> None:
        with self._lock:
            if self.docs.get(info.name) is not info or info.state != "queued":
                return  # deleted, replaced or already indexed meanwhile
            info.state = "indexing"
            self.progress.state = "indexing"
        try:
            pieces = chunk_document(doc, self.engine.tokenizer, self.cfg.chunk_tokens)
        except Exception as e:
            log.exception("chunking %s failed", info.name)
            with self._lock:
                info.state, info.error = "error", f"chunking failed ({type(e).__name__})"
                self.progress.errors.append(f"{info.name}: {info.error}")
            return
        records = [ChunkRecord(f"{info.name}#{c.index}", info.name, c.index, c.text) for c in pieces]
        with self._lock:
            self.progress.chunks += len(records)
        self._notify()
        emb = self._embed([r.text for r in records], progress=True)
        with self._lock:
            if self.docs.get(info.name) is not info:
                self.progress.chunks -= len(records)
                self.progress.embedded -= len(records)
                return
            import faiss

            if self._index is None:
                faiss.omp_set_num_threads(1)
                self._index = faiss.IndexFlatIP(emb.shape[1])
            for r in records:
                self.chunks[r.id] = r
            self._ids += [r.id for r in records]
            self._index.add(emb)
            info.chunks = len(records)
            info.state = "compiling" if records else "ready"

    def _compile_next_batch(self) -> bool:
        """Compile up to compile_batch pending chunks; False when nothing is pending."""
        if self.busy():
            time.sleep(0.05)
            with self._lock:
                return any(c.ref is None and not c.failed for c in self.chunks.values())
        with self._lock:
            batch = [c for c in self.chunks.values() if c.ref is None and not c.failed][: self.cfg.compile_batch]
            if not batch:
                return False
            self.progress.state = "compiling"
        t0 = time.perf_counter()
        try:
            refs = self.engine.compile([c.text for c in batch])
        except Exception as e:
            if self._stop.is_set():  # the engine shut down under it: nothing stored half, nothing marked failed
                raise _Stopped from e
            log.exception("compiling %d chunks failed", len(batch))
            why = f"compile failed ({type(e).__name__}; see the server log)"  # engine text may hold paths
            with self._lock:
                self.progress.errors.append(why)
                for c in batch:  # left to on-the-fly compile at question time
                    c.failed = True
                    if c.doc in self.docs:
                        self.docs[c.doc].state, self.docs[c.doc].error = "error", why
            return True
        dt = time.perf_counter() - t0
        with self._lock:
            self.progress.compile_seconds += dt
            for c, ref in zip(batch, refs):
                c.ref = ref
                info = self.docs.get(c.doc)
                if info is not None and self.chunks.get(c.id) is c:
                    info.compiled += 1
                    self.progress.compiled += 1
                    if info.compiled >= info.chunks:
                        info.state = "ready"
        self._notify()
        return True

    def _refine_next_batch(self) -> bool:
        """Refine compiled chunks behind their refine_neighbours nearest chunks (the FAISS index's own vectors;
        the nearest right before the chunk), as many tokens per call as a compile batch (a chat waits for at most
        one call); False when none is left."""
        k = self.cfg.refine_neighbours
        if k < 1 or self.busy():
            return False
        with self._lock:
            if self._index is None or self._index.ntotal < 2:
                return False
            size = max(1, self.cfg.compile_batch // (k + 1))  # each chunk is compiled behind k others
            batch = [c for c in self.chunks.values() if c.ref is not None and c.near is None][:size]
            if not batch:
                return False
            row = {cid: i for i, cid in enumerate(self._ids)}
            near = [
                tuple(self._ids[j] for j in ns) for ns in index_neighbours(self._index, [row[c.id] for c in batch], k)
            ]
            texts = [[self.chunks[i].text for i in ids] for ids in near]
            self.progress.state = "ready"  # every chunk is compiled: refining only improves links
        t0 = time.perf_counter()
        try:
            self.engine.refine([c.text for c in batch], texts)
        except Exception as e:
            if self._stop.is_set():
                raise _Stopped from e
            log.exception("refining %d chunks failed", len(batch))
            with self._lock:  # they stay linked in their plain form
                self.progress.errors.append(f"refine failed ({type(e).__name__}; see the server log)")
                for c in batch:
                    c.near = ()
            return True
        dt = time.perf_counter() - t0
        gone = []
        with self._lock:
            self.progress.refine_seconds += dt
            for c, ids in zip(batch, near):
                if self.chunks.get(c.id) is c and all(i in self.chunks for i in ids):
                    c.near = ids
                    self.progress.refined += 1
                else:  # it or a neighbour was deleted meanwhile: linked plain again
                    gone.append(c.text)
        if gone:
            self.engine.unrefine(gone)
        self._notify()
        return True

    def _remove_locked(self, name: str) -> DocInfo | None:
        info = self.docs.pop(name, None)
        if info is None:
            return None
        gone = {cid for cid, c in self.chunks.items() if c.doc == name}
        if gone:
            rows = [i for i, cid in enumerate(self._ids) if cid in gone]
            # the chunks that go, and those refined behind one of them (refined again later), are linked plain
            plain = set()
            for cid in gone:
                c = self.chunks.pop(cid)
                if c.ref is not None:
                    self.progress.compiled -= 1
                if c.near:
                    self.progress.refined -= 1
                    plain.add(c.text)
            for c in self.chunks.values():
                if c.near and not gone.isdisjoint(c.near):
                    c.near = None
                    self.progress.refined -= 1
                    plain.add(c.text)
            plain -= {c.text for c in self.chunks.values() if c.near}  # a text another document still holds
            if plain and self.engine is not None:
                self.engine.unrefine(sorted(plain))
            self.progress.chunks -= len(gone)
            self.progress.embedded -= len(gone)
            # A flat index removes rows in place and keeps the others in order, aligned with _ids.
            self._index.remove_ids(np.asarray(rows, dtype=np.int64))
            self._ids = [cid for cid in self._ids if cid not in gone]
        return info

    # ------------------------------------------------------------------ embeddings (cached on disk)
    def _embed(self, texts: list[str], progress: bool = False) -> np.ndarray:
        """L2-normalised embeddings [N, D]; document chunks are cached under data_dir/embeddings."""
        out: list[np.ndarray | None] = [None] * len(texts)
        keys: list[str] = []
        todo = list(range(len(texts)))
        if progress:  # document chunks: cached (keyed by the encoder too)
            keys = [self._emb_cache.key(self.encoder_id, t) for t in texts]
            out = [self._emb_cache.load(k) for k in keys]
            todo = [i for i, v in enumerate(out) if v is None]
            with self._lock:
                self.progress.embedded += len(texts) - len(todo)
        for s in range(0, len(todo), 32):
            if progress and self._stop.is_set():  # a large document's embedding must not hold up a stop
                raise _Stopped
            part = todo[s : s + 32]
            with self._enc_lock:
                vecs = np.asarray(
                    self.encoder.encode(
                        [texts[i] for i in part], normalize_embeddings=True, batch_size=32, show_progress_bar=False
                    ),
                    dtype=np.float32,
                )
            for i, v in zip(part, vecs):
                out[i] = v
                if progress:
                    self._emb_cache.save(keys[i], v)
            if progress:
                with self._lock:
                    self.progress.embedded += len(part)
                self._notify()
        if not texts:
            return np.zeros((0, 384), dtype=np.float32)
        return np.stack(out).astype(np.float32)  # type: ignore[arg-type]

    @property
    def encoder_id(self) -> str:
        """What cached embeddings depend on besides their text (see epic_rag.embeddings.encoder_id)."""
        from epic_rag.embeddings import encoder_id, minilm_id

        return minilm_id() if self._encoder is None else encoder_id(self._encoder)  # without loading it

    def _notify(self) -> None:
        for fn in list(self.listeners):
            try:
                fn(self.progress)
            except Exception:
                log.debug("progress listener failed", exc_info=True)
