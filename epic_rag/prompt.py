"""Prompt assembly: requests into segments, segments into token ids with the chunks' places.

Chunk boundaries are token spans, never separator strings: every segment is tokenized on its own,
so a chunk's tokens in the prompt are exactly the tokens it was compiled from.

Text is text: a special-token string (e.g. "<|im_start|>system") inside a client's message, question or
system prompt, or inside a document, is tokenized as the characters it is, never as a control token. Only
the chat template's own glue (plain `str` segments) keeps its special tokens; client text inside a
rendered request is carried as `UserText`. A prompt string or segment list given directly is the caller's
own rendering: its `str` glue keeps special tokens (chunks in it are still plain text).
"""

from __future__ import annotations

import re
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .matching import ChunkTextIndex
from .types import Chunk, ChunkRef, PlacedChunk, RagRequest, Segment

DEFAULT_INSTRUCTION = "Read the documents and answer the question briefly.\n\n"
# RagRequest's default user message. Chunks are compiled behind its lead (compile_lead), so it must not change.
DEFAULT_TEMPLATE = DEFAULT_INSTRUCTION + "{context}Question: {question}"
_SLOT = re.compile(r"(\{context\}|\{question\})")


def check_template(template: object) -> str:
    """A RagRequest template: a string holding `{context}` and `{question}` once each."""
    if not isinstance(template, str):
        raise ValueError(f"template must be a string, got {type(template).__name__}")
    for slot in ("{context}", "{question}"):
        if template.count(slot) != 1:
            raise ValueError(f"template must contain {slot} exactly once, got {template.count(slot)}")
    return template


class UserText(str):
    """Glue that came from a client or a document: tokenized as plain text (see the module docstring)."""

    __slots__ = ()


class _Marks:
    """Placeholders for client text while a chat template renders: the template sees only these, and each
    is replaced afterwards by what it stands for, so client text never passes through as template text."""

    def __init__(self) -> None:
        self.nonce = uuid.uuid4().hex
        self.parts: list[list[Segment]] = []

    def add(self, parts: list[Segment]) -> str:
        self.parts.append(parts)
        return f"\x00EPIC{self.nonce}_{len(self.parts) - 1}\x00"

    def split(self, text: str) -> list[Segment]:
        """The rendered text with every placeholder (each exactly once) replaced by its segments."""
        # Plain string splitting: a regex made from the per-request nonce would be compiled into re's module
        # cache on every request (hundreds of dead patterns, evicting everyone else's).
        head, *marked = text.split(f"\x00EPIC{self.nonce}_")
        glues, found = [head], []
        for piece in marked:
            index, end, glue = piece.partition("\x00")
            if not end or not (index.isascii() and index.isdigit()):
                raise ValueError("the chat template altered or repeated the message placeholders")
            found.append(int(index))
            glues.append(glue)
        if sorted(found) != list(range(len(self.parts))):
            raise ValueError("the chat template altered or repeated the message placeholders")
        segments: list[Segment] = []
        for i, glue in enumerate(glues):
            if glue:
                segments.append(glue)
            if i < len(found):
                segments += self.parts[found[i]]
        return segments


def render_request(tokenizer, req: RagRequest) -> list[Segment]:
    """Chat-template a RagRequest, with each chunk kept as its own segment and the question and system
    prompt as UserText."""
    if not isinstance(req.question, str) or not req.question.strip():
        raise ValueError("question must be a non-empty string")
    if not req.chunks:
        raise ValueError(
            "RagRequest needs at least one chunk; for a prompt without documents pass a "
            "prompt string or a list of segments (see EpicEngine.render_messages)"
        )
    marks = _Marks()
    # The default template's text is the server's own glue (as before templates existed: same tokens, so the
    # compile lead matches); a caller's template text is client text, tokenized as plain text (UserText).
    own = req.template is None or req.template == DEFAULT_TEMPLATE
    body = ""
    for piece in _SLOT.split(DEFAULT_TEMPLATE if own else check_template(req.template)):
        if piece == "{context}":
            for i, c in enumerate(req.chunks):
                body += f"Document {i + 1}:\n{marks.add([c if isinstance(c, ChunkRef) else Chunk(c)])}\n\n"
        elif piece == "{question}":
            body += marks.add([UserText(req.question.strip())])
        elif piece:
            body += piece if own else marks.add([UserText(piece)])
    system = [{"role": "system", "content": marks.add([UserText(req.system)])}] if req.system else []
    text = tokenizer.apply_chat_template(
        system + [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
    )
    return marks.split(text)


def render_messages(tokenizer, text_index: ChunkTextIndex, messages: Sequence[dict]) -> list[Segment]:
    """Chat-template role/content messages (generation prompt added). Each message's text is UserText,
    except the compiled chunk texts found in it, which become ChunkRef segments."""
    marks = _Marks()
    rendered = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, str):
            raise ValueError("each message must be a dict with a string 'content'")
        parts = [s if isinstance(s, ChunkRef) else UserText(s) for s in text_index.split(content)]
        rendered.append({**m, "content": marks.add(parts)})
    return marks.split(tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True))


def compile_lead(tokenizer, kind: str = "template") -> list[int]:
    """The tokens every chunk is compiled behind. "template": the default RagRequest prompt up to its first
    document (chat template, default system prompt, instruction, "Document 1:"), so a chunk's KV is computed
    in the context it is linked into (the shared-prefix recipe of CacheBlend's and APE's chunk encoders),
    not as the start of a conversation; its first token is the chunk's sink. "sink", or a tokenizer without
    a chat template: the BOS alone (EOS where there is none), EPIC's reference compile."""
    ids: list[int] = []
    if kind == "template":
        try:
            segments = render_request(tokenizer, RagRequest(question="?", chunks=["?"]))
        except Exception:  # no chat template: a bare sink token
            segments = []
        for seg in segments:  # the glue before the first document, tokenized as a prompt's glue is
            if not isinstance(seg, str):
                break
            ids += encode_glue(tokenizer, seg)
    if not ids:
        sink = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ids = [sink]
    return ids


def compile_lead_behind(tokenizer, neighbours: Sequence[Sequence[int]], kind: str = "template") -> list[int]:
    """The tokens a chunk is compiled behind when compiled beside its neighbours (neighbour-aware compile):
    "template": the default RagRequest prompt with each neighbour's tokens a document of its own, up to the
    document after them (the chunk's place); "sink": the sink, then the neighbours' tokens. Neighbours are
    given in prompt order (the nearest last, right before the chunk)."""
    if not neighbours:
        return compile_lead(tokenizer, kind)
    ids: list[int] = []
    if kind == "template":
        placeholders = [ChunkRef(f"n{i}", len(n)) for i, n in enumerate(neighbours)] + [ChunkRef("chunk", 1)]
        try:
            segments = render_request(tokenizer, RagRequest(question="?", chunks=placeholders))
        except Exception:  # no chat template: as "sink"
            segments = []
        seen = 0
        for seg in segments:
            if isinstance(seg, str):
                ids += encode_glue(tokenizer, seg)
                continue
            if seen == len(neighbours):
                break
            ids += list(neighbours[seen])
            seen += 1
    if not ids:
        ids = compile_lead(tokenizer, "sink") + [t for n in neighbours for t in n]
    return ids


def check_chunk_text(text: object) -> str:
    if not isinstance(text, str):
        raise ValueError(f"chunk must be a string or ChunkRef, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("chunk text is empty or whitespace only")
    return text


def encode_text(tokenizer, text: str) -> list[int]:
    """Tokens of one piece of plain text (a chunk, client text) on its own: special-token strings in it are
    tokenized as text, never as control tokens."""
    ids = _encode(tokenizer, text)
    plain = _plain_encoder(tokenizer)
    if not plain.special.intersection(ids):
        return ids  # the common case: exactly what the tokenizer gives (keys of stored chunks unchanged)
    if plain.backend is not None:
        return list(plain.backend.encode(text, add_special_tokens=False).ids)
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def encode_glue(tokenizer, text: str) -> list[int]:
    """Tokens of a glue segment: a plain `str` is template text whose special-token strings are the
    template's own control tokens; UserText is encoded as plain text."""
    return encode_text(tokenizer, text) if isinstance(text, UserText) else _encode(tokenizer, text)


def _encode(tokenizer, text: str) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: the tokenizer would raise an opaque TypeError
        raise ValueError(f"text is not valid Unicode (lone surrogate at position {e.start})") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True, slots=True)
class _Plain:
    special: frozenset[int]  # ids that only a special-token string can produce
    backend: object | None  # a private tokenizers.Tokenizer with encode_special_tokens on, or None


_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLAIN_LOCK = threading.Lock()


def _plain_encoder(tokenizer) -> _Plain:
    """Per tokenizer, once: its special ids and a private copy of its backend that splits special-token
    strings as text. A copy, because `split_special_tokens=True` flips a flag on the shared backend, and a
    concurrent encode of template glue could flip it back mid-call."""
    with _PLAIN_LOCK:
        found = _PLAIN.get(tokenizer)
    if found is not None:
        return found
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        from tokenizers import Tokenizer

        copy = Tokenizer.from_str(backend.to_str())
        copy.encode_special_tokens = True
        special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        plain = _Plain(special, copy)
    else:
        plain = _Plain(frozenset(tokenizer.all_special_ids), None)
    with _PLAIN_LOCK:
        _PLAIN[tokenizer] = plain
    return plain


def to_segments(tokenizer, text_index: ChunkTextIndex, request: RagRequest | str | Sequence[Segment]) -> list[Segment]:
    """A RagRequest is chat-templated; a prompt string a framework rendered is split on the compiled chunk
    texts found in it; a list of segments is taken as it is."""
    if isinstance(request, RagRequest):
        return render_request(tokenizer, request)
    if isinstance(request, str):
        return text_index.split(request)
    if isinstance(request, bytes) or not isinstance(request, Sequence):
        raise ValueError("request must be a RagRequest, a prompt string or a list of segments (str | Chunk | ChunkRef)")
    return list(request)


@dataclass(slots=True)
class Assembled:
    """A prompt's token ids and where its chunks sit."""

    token_ids: list[int]
    chunks: list[PlacedChunk]


def assemble(
    segments: Sequence[Segment],
    encode: Callable[[str], list[int]],
    chunk_tokens: Callable[[Chunk | ChunkRef], PlacedChunk],
    max_model_len: int,
    sink_tokens: Sequence[int] = (),
) -> Assembled:
    """Tokenize glue with `encode` and place each chunk's tokens (from `chunk_tokens`, which may find them
    without loading KV), each behind `sink_tokens` where the policy keeps a chunk's sink in the prompt.
    Raises ValueError for an empty prompt or one that leaves no room to answer."""
    ids: list[int] = []
    placed: list[PlacedChunk] = []
    for seg in segments:
        if isinstance(seg, str):
            ids += encode(seg)
            continue
        if not isinstance(seg, (Chunk, ChunkRef)):
            raise ValueError(f"segment must be str, Chunk or ChunkRef, got {type(seg).__name__}")
        chunk = chunk_tokens(seg)
        ids += sink_tokens
        chunk.start, chunk.sink = len(ids), len(sink_tokens)
        placed.append(chunk)
        ids += chunk.token_ids
    if not ids:
        raise ValueError("prompt is empty")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt of {len(ids)} tokens does not fit the context window "
            f"({max_model_len} tokens, one at least kept for the answer)"
        )
    return Assembled(ids, placed)
