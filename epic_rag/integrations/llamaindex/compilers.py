"""Compile steps for LlamaIndex: EpicChunkCompiler at ingest (a TransformComponent), EpicNodeCompiler at query
time (a node postprocessor). Both compile each node's LLM-visible text, as response synthesis inserts it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle, TransformComponent

from .._shared import (
    adopt_engine,
    shared_engine,
)
from .llm import node_llm_text


class _SharedEngine:
    """For the pipeline components: the engine given, else the process's shared engine (made on first use)."""

    _engine: Any

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._engine = adopt_engine(engine) if engine is not None else None

    @property
    def engine(self):
        if self._engine is None:
            self._engine = shared_engine()
        return self._engine


class EpicChunkCompiler(_SharedEngine, TransformComponent):
    """Ingestion step: compiles every node's LLM-visible text, so queries link it from cache.

    Nodes pass through unchanged. Place it after the steps that set node text and metadata (splitters,
    extractors); embedding steps may come before or after. A new instance (new process) misses the
    IngestionPipeline cache for this step, so chunks are compiled (or found in the store) again there.
    With `neighbours=k` (default 2), each node is then compiled again behind its k nearest nodes of the same batch
    (EpicEngine.refine_nearest; by the nodes' own embeddings where every node has one, so place it after the
    embedding step, else the packaged MiniLM's): links of those chunks use the refined records.
    """

    policy: str | None = Field(default=None, description="Compile for this link policy (default: engine's).")
    batch_size: int = Field(default=32, gt=0, description="Chunks per compile batch.")
    neighbours: int = Field(default=2, ge=0, description="Refine each node behind its k nearest (0: off).")
    session: str = Field(
        default_factory=lambda: uuid.uuid4().hex,
        description="Per instance: keeps the pipeline cache from skipping compilation.",
    )

    _engine: Any = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "EpicChunkCompiler"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        first: dict[str, BaseNode] = {}
        for n in nodes:
            first.setdefault(node_llm_text(n), n)
        texts = [t for t in first if t]
        self.engine.compile(texts, policy=self.policy, batch_size=self.batch_size)
        if self.neighbours and len(texts) > 1:
            emb = [first[t].embedding for t in texts]
            self.engine.refine_nearest(
                texts, k=min(self.neighbours, len(texts) - 1), embeddings=None if None in emb else emb
            )
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        _ = self.engine  # created (if need be) on this thread, not in the worker
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)


def _compile_new(engine: Any, texts: Sequence[str], policy: str | None, batch_size: int) -> int:
    """Compile the texts not yet known to this process's engine (the store skips those it holds); returns how
    many were handed to compile."""
    fresh = [t for t in dict.fromkeys(texts) if t and t.strip() and t not in engine.text_index]
    if fresh:
        engine.compile(fresh, policy=policy, batch_size=batch_size)
    return len(fresh)


class EpicNodeCompiler(_SharedEngine, BaseNodePostprocessor):
    """Query-time step: compiles the retrieved nodes' LLM-visible text, so the LLM call links them.

    Nodes pass through unchanged (order and scores kept), or with `order="relevance"` in ascending order of
    their retriever scores, the most relevant last, nearest the question (LongContextReorder's idea; free under
    linking, which rotates each chunk's keys to wherever it sits). Use it last among the node postprocessors (after
    rerankers and filters, which may change what reaches the prompt), e.g.
    `index.as_query_engine(node_postprocessors=[EpicNodeCompiler()])`, or in a context chat engine.
    For a corpus compiled at ingest (EpicChunkCompiler) in this process it costs a dictionary lookup per node;
    texts whose KV the chunk store already holds (a persisted index after a restart) cost a store lookup.
    """

    policy: str | None = Field(default=None, description="Compile for this link policy (default: engine's).")
    batch_size: int = Field(default=32, gt=0, description="Chunks per compile batch.")
    order: Literal["given", "relevance"] = Field(
        default="given", description="'relevance': nodes by ascending score, the most relevant nearest the question."
    )

    _engine: Any = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "EpicNodeCompiler"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        _compile_new(self.engine, [node_llm_text(n.node) for n in nodes], self.policy, self.batch_size)
        if self.order == "relevance":  # stable: unscored nodes first, ties keep their order
            nodes = sorted(nodes, key=lambda n: float("-inf") if n.score is None else n.score)
        return nodes

    async def _apostprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        _ = self.engine  # created (if need be) on this thread, not in the worker
        return await asyncio.to_thread(self._postprocess_nodes, nodes, query_bundle)
