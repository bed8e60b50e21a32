"""Render requests into segments, and segments into token ids with chunk spans.

Chunk boundaries are token spans, never separator strings: every segment is tokenized on its own,
so a chunk's tokens in the prompt are exactly the tokens it was compiled from.
"""
from __future__ import annotations

import uuid

from .types import Chunk, ChunkRef, RagRequest, Segment

DEFAULT_INSTRUCTION = "Read the documents and answer the question briefly.\n\n"


def render_request(tokenizer, req: RagRequest) -> list[Segment]:
    """Chat-template a RagRequest, with each chunk kept as its own segment."""
    if not isinstance(req.question, str) or not req.question.strip():
        raise ValueError("question must be a non-empty string")
    if not req.chunks:
        raise ValueError("RagRequest needs at least one chunk; for a prompt without documents pass a "
                         "prompt string or a list of segments (see EpicEngine.render_messages)")
    marks = [f"\x00EPIC{uuid.uuid4().hex}_{i}\x00" for i in range(len(req.chunks))]
    body = DEFAULT_INSTRUCTION
    for i, m in enumerate(marks):
        body += f"Document {i + 1}:\n{m}\n\n"
    body += f"Question: {req.question.strip()}"
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
        [{"role": "user", "content": body}]
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
    except UnicodeEncodeError as e:   # a lone surrogate: the tokenizer would raise an opaque TypeError
        raise ValueError(f"text is not valid Unicode (lone surrogate at position {e.start})") from None
    return list(tokenizer.encode(text, add_special_tokens=False))
