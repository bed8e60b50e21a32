"""Document loading and token-sized chunking, shared by the CLI, the demo and the benchmarks.

Sources: a folder of .txt/.md files (and .pdf/.html where pypdf / the stdlib parser read them), single
files, or "builtin:pydoc" (Python's own documentation of common stdlib modules, present on every machine).
"""

from __future__ import annotations

import html
import io
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

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


def read_document(name: str, data: bytes) -> Document:
    """Decode one uploaded/loaded file; raises ValueError for unsupported or unreadable content."""
    suffix = Path(name).suffix.lower()
    if suffix not in DOC_SUFFIXES:
        raise ValueError(f"unsupported file type {suffix or '(none)'}; supported: {', '.join(sorted(DOC_SUFFIXES))}")
    if suffix == ".pdf":
        try:
            from pypdf import PdfReader
        except ImportError as e:  # pragma: no cover
            raise ValueError("reading PDF needs the pypdf package") from e
        try:
            text = "\n\n".join((p.extract_text() or "") for p in PdfReader(io.BytesIO(data)).pages)
        except Exception as e:
            raise ValueError(f"{name}: not a readable PDF ({e})") from e
    else:
        if b"\x00" in data:
            raise ValueError(f"{name}: binary content (NUL bytes) in a text file")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{name}: not valid UTF-8 ({e.reason} at byte {e.start})") from e
        if suffix in (".html", ".htm"):
            p = _HTMLText()
            p.feed(text)
            text = html.unescape(" ".join(p.parts))
    text = re.sub(r"[ \t]+\n", "\n", text).strip()
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
            except ValueError:
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
