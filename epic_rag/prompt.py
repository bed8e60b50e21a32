"""Prompt assembly: requests into segments, segments into token ids with the chunks' places.

Chunk boundaries are token spans, never separator strings: every segment is tokenized on its own,
so a chunk's tokens in the prompt are exactly the tokens it was compiled from.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .matching import ChunkTextIndex
from .types import Chunk, ChunkRef, PlacedChunk, RagRequest, Segment

DEFAULT_INSTRUCTION = "Read the documents and answer the question briefly.\n\n"


def render_request(tokenizer, req: RagRequest) -> list[Segment]:
    """Chat-template a RagRequest, with each chunk kept as its own segment."""
    if not isinstance(req.question, str) or not req.question.strip():
        raise ValueError("question must be a non-empty string")
    if not req.chunks:
        raise ValueError(
            "RagRequest needs at least one chunk; for a prompt without documents pass a "
            "prompt string or a list of segments (see EpicEngine.render_messages)"
        )
    marks = [f"\x00EPIC{uuid.uuid4().hex}_{i}\x00" for i in range(len(req.chunks))]
    body = DEFAULT_INSTRUCTION
    for i, m in enumerate(marks):
        body += f"Document {i + 1}:\n{m}\n\n"
    body += f"Question: {req.question.strip()}"
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + [{"role": "user", "content": body}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    segments: list[Segment] = []
    for i, m in enumerate(marks):
        before, found, text = text.partition(m)
        if not found:
            raise ValueError("the chat template altered the document placeholders")
        if before:
            segments.append(before)
        c = req.chunks[i]
        segments.append(c if isinstance(c, ChunkRef) else Chunk(c))
    if text:
        segments.append(text)
    return segments


def compile_lead(tokenizer, kind: str = "template") -> list[int]:
    """The tokens every chunk is compiled behind. "template": the default RagRequest prompt up to its first
    document (chat template, default system prompt, instruction, "Document 1:"), so a chunk's KV is computed
    in the context it is linked into (the shared-prefix recipe of CacheBlend's and APE's chunk encoders),
    not as the start of a conversation; its first token is the chunk's sink. "sink", or a tokenizer without
    a chat template: the BOS alone (EOS where there is none), EPIC's reference compile."""
    lead = None
    if kind == "template":
        try:
            lead = render_request(tokenizer, RagRequest(question="?", chunks=["?"]))[0]
        except Exception:  # no chat template: a bare sink token
            lead = None
    ids = encode_text(tokenizer, lead) if isinstance(lead, str) else []
    if not ids:
        sink = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ids = [sink]
    return ids


def check_chunk_text(text: object) -> str:
    if not isinstance(text, str):
        raise ValueError(f"chunk must be a string or ChunkRef, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("chunk text is empty or whitespace only")
    return text


def encode_text(tokenizer, text: str) -> list[int]:
    """Tokens of one piece on its own; special-token strings in the template become special ids."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: the tokenizer would raise an opaque TypeError
        raise ValueError(f"text is not valid Unicode (lone surrogate at position {e.start})") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


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
