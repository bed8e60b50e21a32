"""Document loading and token-sized chunking, shared by the CLI, the demo and the benchmarks.

Sources: a folder of .txt/.md files (and .pdf/.html where pypdf / the stdlib parser read them), single
files, or "builtin:pydoc" (Python's own documentation of common stdlib modules, present on every machine).
"""

from __future__ import annotations

import html
import io
import logging
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

log = logging.getLogger(__name__)

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py"}
DOC_SUFFIXES = TEXT_SUFFIXES | {".html", ".htm", ".pdf"}
PYDOC_MODULES = [
    "json",
    "os.path",
    "pathlib",
    "re",
    "collections",
    "itertools",
    "functools",
    "datetime",
    "csv",
    "argparse",
    "logging",
    "subprocess",
    "shutil",
    "random",
    "statistics",
    "textwrap",
    "string",
    "heapq",
    "bisect",
    "dataclasses",
]


@dataclass(frozen=True, slots=True)
class Document:
    name: str
    text: str


@dataclass(frozen=True, slots=True)
class TextChunk:
    doc: str
    index: int
    text: str


class _HTMLText(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        self._skip += tag in ("script", "style")

    def handle_endtag(self, tag):
        self._skip -= tag in ("script", "style") and self._skip > 0

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


# Limits on what one document may cost to parse (the demo passes its own; see ParseLimits).
MAX_DOC_CHARS = 10 << 20  # characters of decoded/extracted text per document
MAX_PDF_PAGES = 2000


@dataclass(frozen=True, slots=True)
class ParseLimits:
    """What one HTML/PDF extraction may use in its worker process: CPU seconds, address space, wall time,
    pages and characters of output. A document over any of them is refused (ValueError)."""

    cpu_s: int = 20
    memory_bytes: int = 1 << 30
    wall_s: float = 60.0
    max_pages: int = MAX_PDF_PAGES
    max_chars: int = MAX_DOC_CHARS


def normalise_text(text: str) -> str:
    """Trailing blanks off every line, outer whitespace off the whole. Linear time: the regex this
    replaces (`[ \\t]+\\n`) was quadratic on a long run of spaces and held the GIL for hours."""
    return "\n".join(line.rstrip(" \t") for line in text.split("\n")).strip()


def _extract_markup(suffix: str, data: bytes, max_pages: int, max_chars: int) -> str:
    """HTML or PDF bytes -> text, in-process (the worker runs this under resource limits)."""
    if suffix == ".pdf":
        from pypdf import PdfReader

        reader = PdfReader(io.BytesIO(data))
        if len(reader.pages) > max_pages:
            raise ValueError(f"PDF has {len(reader.pages)} pages; the limit is {max_pages}")
        parts: list[str] = []
        size = 0
        for page in reader.pages:
            t = page.extract_text() or ""
            parts.append(t)
            size += len(t) + 2
            if size > max_chars:
                break
        return "\n\n".join(parts)[: max_chars + 1]
    p = _HTMLText()
    p.feed(_decode(data))
    p.close()
    return html.unescape(" ".join(p.parts))[: max_chars + 1]


def _extract_child(conn, suffix: str, data: bytes, limits: ParseLimits) -> None:
    import resource

    # Hard caps the kernel enforces: a parser stuck in a loop gets SIGXCPU/SIGKILL, one that balloons
    # gets MemoryError; either way only this child dies.
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    try:
        out: tuple[str, str] = ("ok", _extract_markup(suffix, data, limits.max_pages, limits.max_chars))
    except MemoryError:
        out = ("error", "needs more memory than the parser may use")
    except BaseException as e:  # any parser failure (html.parser raises AssertionError on '<![')
        out = ("error", f"{type(e).__name__}: {str(e)[:200]}")
    conn.send(out)
    conn.close()


def extract_isolated(suffix: str, data: bytes, limits: ParseLimits) -> str:
    """Run _extract_markup in a fresh worker process (forkserver: no copy of this process's threads or
    engine) under `limits`; ValueError on any failure, timeout or limit. Keeps the GIL of this process
    free, so a hostile HTML/PDF file cannot stall the server. As with any multiprocessing start method but
    fork, a script that calls this needs an `if __name__ == "__main__":` guard."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_extract_child, args=(child, suffix, data, limits), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(limits.wall_s):
            raise ValueError(f"parsing took longer than {limits.wall_s:g} s")
        kind, payload = parent.recv()
    except (EOFError, OSError):  # the child died: CPU limit (SIGXCPU) or killed
        raise ValueError("the parser exceeded its CPU or memory limit") from None
    finally:
        parent.close()
        if proc.is_alive():
            proc.kill()
        proc.join(5)
    if kind != "ok":
        raise ValueError(payload)
    return payload


def _decode(data: bytes) -> str:
    if b"\x00" in data:
        raise ValueError("binary content (NUL bytes) in a text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from e


def read_document(name: str, data: bytes, limits: ParseLimits | None = None) -> Document:
    """Decode one uploaded/loaded file; raises ValueError for unsupported, unreadable or oversized
    content. HTML and PDF are parsed in a worker process under `limits` (extract_isolated)."""
    limits = limits or ParseLimits()
    suffix = Path(name).suffix.lower()
    if suffix not in DOC_SUFFIXES:
        raise ValueError(f"unsupported file type {suffix or '(none)'}; supported: {', '.join(sorted(DOC_SUFFIXES))}")
    try:
        if suffix in (".pdf", ".html", ".htm"):
            if suffix == ".pdf" and not data.startswith(b"%PDF"):
                raise ValueError("not a PDF file")
            text = extract_isolated(suffix, data, limits)
        else:
            text = _decode(data)
    except ValueError as e:
        kind = {".pdf": "PDF", ".html": "HTML", ".htm": "HTML"}.get(suffix, "text")
        raise ValueError(f"{name}: not a readable {kind} file ({e})") from None
    if len(text) > limits.max_chars:
        raise ValueError(f"{name}: more than {limits.max_chars} characters of text")
    text = normalise_text(text)
    if not text:
        raise ValueError(f"{name}: no text")
    return Document(Path(name).name, text)


def pydoc_documents(modules: list[str] = PYDOC_MODULES) -> list[Document]:
    import importlib
    import pydoc

    docs = []
    for mod in modules:
        try:
            obj = importlib.import_module(mod)
        except ImportError:
            continue
        text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
        # default values render with their memory address ("<function copy2 at 0x7f...>"): dropped, so the
        # text (and every chunk key and embedding made from it) is the same in every process
        text = re.sub(r" at 0x[0-9a-fA-F]+\b", "", text)
        docs.append(Document(f"pydoc-{mod}.txt", text))
    return docs


def load_documents(source: str | Path) -> list[Document]:
    """Documents from "builtin:pydoc", a file, or a folder (recursively, supported types only)."""
    if str(source) == "builtin:pydoc":
        return pydoc_documents()
    path = Path(source)
    if path.is_file():
        return [read_document(path.name, path.read_bytes())]
    if not path.is_dir():
        raise ValueError(f"no such file or folder: {source}")
    docs = []
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.suffix.lower() in DOC_SUFFIXES:
            try:
                docs.append(read_document(p.name, p.read_bytes()))
            except (ValueError, OSError) as e:  # one bad file is skipped, never the whole corpus
                log.warning("skipping %s: %s", p, e)
                continue
    if not docs:
        raise ValueError(f"{source}: no readable documents ({', '.join(sorted(DOC_SUFFIXES))})")
    return docs


def chunk_document(doc: Document, tokenizer, max_tokens: int = 512) -> list[TextChunk]:
    """Greedy packing of paragraphs (then lines, then token windows for overlong lines) into chunks of
    at most max_tokens tokens, so each chunk is a readable run of text."""

    def ntok(s: str) -> int:
        return len(tokenizer.encode(s, add_special_tokens=False))

    units: list[tuple[str, str, int]] = []  # (joiner before, text, tokens)
    for para in re.split(r"\n\s*\n", doc.text):
        para = para.strip()
        if not para:
            continue
        n = ntok(para)
        if n <= max_tokens:
            units.append(("\n\n", para, n))
            continue
        for j, line in enumerate(para.split("\n")):
            joiner = "\n\n" if j == 0 else "\n"
            ids = tokenizer.encode(line, add_special_tokens=False)
            for k in range(0, max(len(ids), 1), max_tokens):
                piece = tokenizer.decode(ids[k : k + max_tokens]) if len(ids) > max_tokens else line
                if piece.strip():
                    units.append((joiner if k == 0 else " ", piece, min(len(ids) - k, max_tokens)))
    chunks: list[str] = []
    cur, cur_n = "", 0
    for joiner, text, n in units:
        # +2 leaves room for the joiner's own tokens; the final check below is exact.
        if cur and cur_n + n + 2 > max_tokens:
            chunks.append(cur)
            cur, cur_n = "", 0
        cur = f"{cur}{joiner}{text}" if cur else text
        cur_n += n + (2 if cur_n else 0)
    if cur:
        chunks.append(cur)
    return [TextChunk(doc.name, i, c.strip()) for i, c in enumerate(chunks) if c.strip()]
