"""Chunk order by relevance: a RagRequest's chunks placed in ascending order of relevance, the most relevant
last, nearest the question (LlamaIndex's LongContextReorder idea). Under linking it costs nothing: every chunk's
keys are rotated to wherever it sits. Relevance is the retriever's score (RagRequest.scores), or, where none is
given, the packaged MiniLM's cosine between the question and each chunk."""

from __future__ import annotations

import dataclasses
import math

from ..types import ChunkRef, RagRequest

ORDERS = ("given", "relevance")


def order_request(request, order: str) -> tuple[object, list[int] | None]:
    """`request` with its chunks in `order`, and their indices in prompt order (None: as given). Only a
    RagRequest is reordered; asking "relevance" of a prompt string or segment list is an error."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if order == "given":
        if isinstance(request, RagRequest) and request.scores is not None:
            check_scores(request.scores, len(request.chunks))
        return request, None
    if not isinstance(request, RagRequest):
        raise ValueError("order='relevance' reorders a RagRequest's chunks; a rendered prompt keeps its order")
    scores = request.scores
    if scores is None:
        scores = minilm_scores(request.question, [c.text if isinstance(c, ChunkRef) else c for c in request.chunks])
    check_scores(scores, len(request.chunks))
    idx = sorted(range(len(scores)), key=lambda i: scores[i])  # stable: ties keep the given order
    return dataclasses.replace(request, chunks=[request.chunks[i] for i in idx], scores=None), idx


def check_scores(scores, n: int) -> None:
    if not isinstance(scores, (list, tuple)) or len(scores) != n:
        raise ValueError(f"scores must be a list of {n} numbers (one per chunk)")
    for s in scores:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise ValueError(f"scores must be finite numbers, got {s!r}")


def minilm_scores(question: str, texts: list[str | None]) -> list[float]:
    """Cosine similarity of each chunk text to the question (packaged all-MiniLM-L6-v2)."""
    if any(t is None for t in texts):
        raise ValueError("order='relevance' without scores needs every chunk's text (a ChunkRef without text)")
    from ..embeddings import sentence_encoder

    emb = sentence_encoder().encode([question, *texts], normalize_embeddings=True, show_progress_bar=False)
    return [float(emb[0] @ e) for e in emb[1:]]
