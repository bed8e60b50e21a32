"""Retrieval-time compile steps on a recording engine (no model): EpicNodeCompiler (LlamaIndex node
postprocessor) and EpicDocumentCompiler (LangChain runnable) compile what the prompt will show, once, and pass
their input through unchanged."""

from __future__ import annotations

import pytest

from epic_rag.types import ChunkRef


class RecordingEngine:
    def __init__(self) -> None:
        self.text_index: set[str] = set()
        self.compiled: list[list[str]] = []

    def compile(self, texts, policy=None, batch_size=32):
        self.compiled.append(list(texts))
        self.text_index.update(texts)
        return [ChunkRef(f"k{i}", 3, t) for i, t in enumerate(texts)]

    def refine_nearest(self, texts, k=2, embeddings=None, batch_size=8):
        self.refined = (list(texts), k, embeddings)
        return [ChunkRef(f"r{i}", 3, t) for i, t in enumerate(texts)]


@pytest.fixture()
def engine():
    return RecordingEngine()


def test_node_compiler_compiles_the_llm_visible_text_once_and_passes_nodes_through(engine):
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import NodeWithScore, TextNode

    from epic_rag.integrations.llamaindex import EpicNodeCompiler, node_llm_text

    nodes = [
        NodeWithScore(node=TextNode(text="alpha text", id_="a", metadata={"doc": "a.txt"}), score=0.9),
        NodeWithScore(node=TextNode(text="beta text", id_="b", metadata={"doc": "b.txt"}), score=0.5),
        NodeWithScore(node=TextNode(text="alpha text", id_="a", metadata={"doc": "a.txt"}), score=0.4),
    ]
    pp = EpicNodeCompiler()
    pp._engine = engine  # not adopt_engine: the recording engine must not become the process's shared one
    out = pp.postprocess_nodes(nodes, query_str="q")
    assert out == nodes and [n.score for n in out] == [0.9, 0.5, 0.4]
    assert engine.compiled == [["doc: a.txt\n\nalpha text", "doc: b.txt\n\nbeta text"]]
    assert engine.compiled[0][0] == node_llm_text(nodes[0].node)  # metadata header included, as prompts show it
    pp.postprocess_nodes(nodes[:2], query_str="again")
    assert len(engine.compiled) == 1  # already compiled in this process: nothing handed to compile


def test_node_compiler_relevance_order_puts_the_best_scored_node_last_nearest_the_question(engine):
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import NodeWithScore, TextNode

    from epic_rag.integrations.llamaindex import EpicNodeCompiler

    nodes = [
        NodeWithScore(node=TextNode(text=t, id_=t), score=s)
        for t, s in (("best", 0.9), ("unscored", None), ("worst", 0.1), ("middle", 0.5))
    ]
    pp = EpicNodeCompiler(order="relevance")
    pp._engine = engine
    out = pp.postprocess_nodes(nodes, query_str="q")
    assert [n.node.text for n in out] == ["unscored", "worst", "middle", "best"]
    assert [n.node.text for n in nodes] == ["best", "unscored", "worst", "middle"]  # the input is left as it was


def test_chunk_compiler_refines_each_node_behind_its_nearest_by_the_nodes_own_embeddings(engine):
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import TextNode

    from epic_rag.integrations.llamaindex import EpicChunkCompiler

    nodes = [TextNode(text=t, id_=t, embedding=e) for t, e in (("a", [1.0, 0.0]), ("b", [0.0, 1.0]), ("c", [1, 1]))]
    step = EpicChunkCompiler(neighbours=5)
    step._engine = engine
    assert step(nodes) == nodes
    assert engine.refined == (["a", "b", "c"], 2, [[1.0, 0.0], [0.0, 1.0], [1, 1]])  # k capped at the others
    nodes[1].embedding = None  # one node without an embedding: the engine's own embedder for the batch
    step(nodes)
    assert engine.refined[2] is None
    assert EpicChunkCompiler().neighbours == 2  # the default: refined behind the 2 nearest
    off = EpicChunkCompiler(neighbours=0)
    off._engine = engine
    del engine.refined
    off(nodes)
    assert not hasattr(engine, "refined")  # neighbours=0: no refine


async def test_node_compiler_async_form(engine):
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import NodeWithScore, TextNode

    from epic_rag.integrations.llamaindex import EpicNodeCompiler

    pp = EpicNodeCompiler()
    pp._engine = engine
    nodes = [NodeWithScore(node=TextNode(text="gamma text", id_="g"), score=1.0)]
    assert await pp.apostprocess_nodes(nodes, query_str="q") == nodes
    assert engine.compiled == [["gamma text"]]


def test_document_compiler_compiles_page_content_verbatim_and_passes_documents_through(engine):
    pytest.importorskip("langchain_core")
    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda

    from epic_rag.integrations.langchain import EpicDocumentCompiler

    docs = [Document("one doc\n", id="1"), Document("two doc"), Document("one doc\n"), Document("   ")]
    comp = EpicDocumentCompiler()
    comp._engine = engine
    chain = RunnableLambda(lambda q: docs) | comp
    assert chain.invoke("q") == docs
    assert engine.compiled == [["one doc\n", "two doc"]]  # whitespace-only skipped, duplicates once
    chain.invoke("q")
    assert len(engine.compiled) == 1
    with pytest.raises(ValueError, match="Documents"):
        comp.invoke(["not a document"])


async def test_document_compiler_async_form(engine):
    pytest.importorskip("langchain_core")
    from langchain_core.documents import Document

    from epic_rag.integrations.langchain import EpicDocumentCompiler

    comp = EpicDocumentCompiler()
    comp._engine = engine
    docs = [Document("three doc")]
    assert await comp.ainvoke(docs) == docs
    assert engine.compiled == [["three doc"]]


def test_compile_documents_refines_each_document_behind_its_nearest_by_the_vector_stores_embeddings(engine, request):
    pytest.importorskip("langchain_core")
    from langchain_core.documents import Document
    from langchain_core.embeddings import Embeddings

    from epic_rag.integrations.langchain import compile_documents

    class TableEmbeddings(Embeddings):  # a vector store's embedder: one fixed vector per text
        table = {"a": [1.0, 0.0], "b": [0.0, 1.0], "c": [1.0, 1.0]}

        def embed_documents(self, texts):
            return [self.table[t] for t in texts]

        def embed_query(self, text):
            return self.table[text]

    from epic_rag.integrations._shared import peek_shared_engine, set_shared_engine

    before = peek_shared_engine()  # compile_documents adopts the engine given: not this recording one
    request.addfinalizer(lambda: set_shared_engine(before))
    docs = [Document("a"), Document("b"), Document("a"), Document("c"), Document("  ")]
    refs = compile_documents(docs, engine=engine, neighbours=5, embeddings=TableEmbeddings())
    assert len(refs) == len(docs)  # one ref per Document, in input order
    assert engine.refined == (["a", "b", "c"], 2, [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # k capped, texts once
    compile_documents(docs[:2], engine=engine, neighbours=1)
    assert engine.refined == (["a", "b"], 1, None)  # no embeddings given: the engine's packaged embedder
    compile_documents(docs[:2], engine=engine)
    assert engine.refined == (["a", "b"], 1, None)  # the default: refined behind up to 2 nearest
    del engine.refined
    compile_documents(docs, engine=engine, neighbours=0)
    assert not hasattr(engine, "refined")  # neighbours=0: no refine
    with pytest.raises(ValueError, match="neighbours"):
        compile_documents(docs, engine=engine, neighbours=-1)
