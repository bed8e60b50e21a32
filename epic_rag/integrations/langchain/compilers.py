"""Compile steps for LangChain: compile_documents, and EpicDocumentCompiler (a pass-through Runnable compiling
Documents at query time, between a retriever and a prompt)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.runnables import (
    RunnableConfig,
    RunnableSerializable,
)
from langchain_core.runnables.config import run_in_executor
from pydantic import ConfigDict, Field, PrivateAttr

from ...types import ChunkRef
from .._shared import (
    adopt_engine,
    shared_engine,
)


def compile_documents(
    documents: Sequence[Document],
    engine: Any = None,
    policy: str | None = None,
    batch_size: int = 32,
    neighbours: int = 2,
    embeddings: Embeddings | None = None,
) -> list[ChunkRef]:
    """Compile the Documents' page_content (at ingest), so prompts that insert them verbatim link them and
    chains that pass them as chunks find them compiled. Returns the refs in input order.

    `neighbours=k` (default 2; 0: off): then compile each Document again behind its k nearest of `documents`
    (neighbour-aware compile, EpicEngine.refine_nearest), by `embeddings` (the vector store's own, e.g.
    `vectorstore.embeddings`; default: the packaged MiniLM); links of those texts use the refined records, which
    the default policy, auto, links fast (legolink-16)."""
    if neighbours < 0:
        raise ValueError(f"neighbours must be >= 0, got {neighbours}")
    eng = adopt_engine(engine) if engine is not None else shared_engine()
    refs = eng.compile([d.page_content for d in documents], policy=policy, batch_size=batch_size)
    texts = list(dict.fromkeys(d.page_content for d in documents if d.page_content.strip()))
    if neighbours and len(texts) > 1:
        vecs = embeddings.embed_documents(texts) if embeddings is not None else None
        eng.refine_nearest(texts, k=min(neighbours, len(texts) - 1), embeddings=vecs, batch_size=batch_size)
    return refs


class EpicDocumentCompiler(RunnableSerializable[Sequence[Document], list[Document]]):
    """Documents in, the same Documents out, their page_content compiled on the way (a retrieval-time step).

    `retriever | EpicDocumentCompiler() | ...`: a prompt that inserts page_content verbatim (e.g.
    `create_stuff_documents_chain`) then links them. Texts already compiled in this process are skipped;
    the chunk store skips those it holds.
    """

    policy: str | None = None
    batch_size: int = Field(default=32, gt=0)

    model_config = ConfigDict(arbitrary_types_allowed=True)

    _engine: Any = PrivateAttr(default=None)

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if engine is not None:
            self._engine = adopt_engine(engine)

    @property
    def engine(self):
        if self._engine is None:
            self._engine = shared_engine()
        return self._engine

    def _compile(self, docs: Any) -> list[Document]:
        docs = list(docs)
        if not all(isinstance(d, Document) for d in docs):
            raise ValueError("EpicDocumentCompiler takes a list of Documents")
        eng = self.engine
        fresh = [t for t in dict.fromkeys(d.page_content for d in docs) if t.strip() and t not in eng.text_index]
        if fresh:
            eng.compile(fresh, policy=self.policy, batch_size=self.batch_size)
        return docs

    def invoke(self, input: Sequence[Document], config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        return self._call_with_config(self._compile, input, config)

    async def ainvoke(
        self, input: Sequence[Document], config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[Document]:
        _ = self.engine  # created (if need be) on this thread, not in the worker

        async def run(docs: Any) -> list[Document]:
            return await run_in_executor(None, self._compile, docs)

        return await self._acall_with_config(run, input, config)
