"""LlamaIndex on the real SmolLM2: a stock VectorStoreIndex query engine over FAISS (llama-index-vector-stores-faiss)
with the packaged all-MiniLM-L6-v2 embeddings, on Python's pydoc text, linking retrieved nodes from cache."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("llama_index.core")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _llamaindex_events import caught  # noqa: E402
from llama_index.core import Settings, StorageContext, VectorStoreIndex, load_index_from_storage  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage  # noqa: E402
from llama_index.core.base.response.schema import Response, StreamingResponse  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.instrumentation.events.llm import (  # noqa: E402
    LLMChatEndEvent,
    LLMChatInProgressEvent,
    LLMChatStartEvent,
    LLMCompletionEndEvent,
)
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402
from llama_index.core.schema import TextNode  # noqa: E402

from epic_rag.integrations import STAT_KEYS  # noqa: E402
from epic_rag.integrations.llamaindex import (  # noqa: E402
    EpicChunkCompiler,
    EpicLLM,
    EpicNodeCompiler,
    EpicSynthesizer,
    node_llm_text,
)

pytestmark = pytest.mark.smollm

# Retrieve the same two heapq chunks, in opposite orders (checked in the tests).
Q1 = "What does heapq.heappush do?"
Q2 = "What does heapq.heappop do?"


@pytest.fixture
def events():
    with caught() as (events, _):
        yield events


def _pydoc_nodes(tokenizer) -> list[TextNode]:
    from epic_rag.corpus import chunk_document, pydoc_documents

    nodes = []
    for d in pydoc_documents(["json", "heapq", "bisect"]):
        for c in chunk_document(d, tokenizer, max_tokens=192):
            # The metadata header ("doc: pydoc-heapq.txt") is part of what the LLM sees; not embedded.
            nodes.append(
                TextNode(
                    text=c.text, id_=f"{c.doc}#{c.index}", metadata={"doc": c.doc}, excluded_embed_metadata_keys=["doc"]
                )
            )
    return nodes


@pytest.fixture(scope="module")
def li_index(smol_engine):
    import faiss
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.vector_stores.faiss import FaissVectorStore

    from epic_rag.embeddings import minilm_dir

    saved = (Settings._llm, Settings._embed_model)
    Settings.embed_model = HuggingFaceEmbedding(model_name=str(minilm_dir()))
    Settings.llm = EpicLLM(engine=smol_engine, max_tokens=24)
    compiler = EpicChunkCompiler(engine=smol_engine)
    nodes = IngestionPipeline(transformations=[compiler, Settings.embed_model]).run(
        nodes=_pydoc_nodes(smol_engine.tokenizer)
    )
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(384))
    index = VectorStoreIndex(nodes, storage_context=StorageContext.from_defaults(vector_store=store))
    yield index
    Settings._llm, Settings._embed_model = saved


def _chat_end(events) -> LLMChatEndEvent:
    ends = [e for e in events if isinstance(e, LLMChatEndEvent)]
    assert len(ends) == 1, [type(e).__name__ for e in events]
    return ends[0]


def test_ingestion_compiles_each_node_llm_text_including_the_metadata_header(smol_engine, li_index):
    node = li_index.docstore.get_node("pydoc-heapq.txt#2")
    text = node_llm_text(node)
    assert text.startswith("doc: pydoc-heapq.txt\n\n")
    assert smol_engine.text_index.get(text) is not None


def test_stock_query_engine_answers_from_the_index_with_linked_chunks(smol_engine, li_index, events):
    qe = li_index.as_query_engine(similarity_top_k=2)  # default response mode (compact)
    response = qe.query(Q1)
    assert isinstance(response, Response) and response.response.strip()
    assert [n.node.node_id for n in response.source_nodes] == ["pydoc-heapq.txt#7", "pydoc-heapq.txt#2"]
    stats = _chat_end(events).response.additional_kwargs
    assert set(STAT_KEYS) <= set(stats)
    assert stats["chunk_hits"] == 2 and stats["chunk_misses"] == 0 and stats["linked_tokens"] > 0
    toks = [smol_engine.chunks.chunk_tokens(node_llm_text(n.node)) for n in response.source_nodes]
    refined = [smol_engine.chunk_key(t, smol_engine.chunks.form_of(t)) for t in toks]
    plain = [smol_engine.text_index.get(node_llm_text(n.node)).key for n in response.source_nodes]
    # the retrieved nodes, in prompt order, in the form EpicChunkCompiler refined them into (its default)
    assert stats["chunk_keys"] == refined and not set(refined) & set(plain)
    assert any(isinstance(e, LLMChatStartEvent) for e in events)


def test_second_question_with_same_chunks_in_another_order_compiles_nothing(smol_engine, li_index, events):
    qe = li_index.as_query_engine(similarity_top_k=2)
    first = qe.query(Q1)
    events.clear()
    second = qe.query(Q2)
    ids1 = [n.node.node_id for n in first.source_nodes]
    ids2 = [n.node.node_id for n in second.source_nodes]
    assert ids2 == ids1[::-1]
    stats = _chat_end(events).response.additional_kwargs
    assert stats["chunk_misses"] == 0 and stats["chunk_hits"] == 2
    assert 0 < stats["recomputed_tokens"] < stats["prompt_tokens"]


def test_token_counting_handler_counts_the_engines_prompt_and_linked_tokens(li_index, events):
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler

    counter = TokenCountingHandler(tokenizer=lambda s: [0] * 100000)  # would be wildly off if used
    saved = Settings._callback_manager, Settings.llm.callback_manager
    Settings.callback_manager = CallbackManager([counter])  # as LlamaIndex documents the handler
    try:
        li_index.as_query_engine(similarity_top_k=2).query(Q1)
    finally:
        Settings._callback_manager, Settings.llm.callback_manager = saved
    resp = _chat_end(events).response
    usage = resp.raw["usage"]
    assert usage["prompt_tokens"] == resp.additional_kwargs["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == resp.additional_kwargs["linked_tokens"] > 0
    assert counter.prompt_llm_token_count == usage["prompt_tokens"]
    assert counter.completion_llm_token_count == usage["completion_tokens"] > 0


def test_stock_streaming_query_engine_links_chunks(li_index, events):
    qe = li_index.as_query_engine(similarity_top_k=2, streaming=True)
    response = qe.query(Q2)
    assert isinstance(response, StreamingResponse)
    pieces = list(response.response_gen)
    assert len([p for p in pieces if p]) > 1 and "".join(pieces).strip()
    stats = _chat_end(events).response.additional_kwargs
    assert stats["chunk_hits"] == 2 and stats["chunk_misses"] == 0


def test_epic_synthesizer_passes_nodes_as_chunks_and_fills_response_metadata(smol_engine, li_index):
    retriever = li_index.as_retriever(similarity_top_k=2)
    qe = RetrieverQueryEngine(retriever, response_synthesizer=EpicSynthesizer(llm=Settings.llm))
    response = qe.query(Q1)
    assert response.response.strip()
    meta = response.metadata
    assert set(STAT_KEYS) <= set(meta)
    assert meta["chunk_hits"] == 2 and meta["chunk_misses"] == 0 and meta["linked_tokens"] > 0
    assert "pydoc-heapq.txt#2" in meta  # the usual node metadata stays


def test_epic_synthesizer_streaming_fills_metadata_when_the_stream_ends(li_index):
    retriever = li_index.as_retriever(similarity_top_k=2)
    qe = RetrieverQueryEngine(retriever, response_synthesizer=EpicSynthesizer(llm=Settings.llm, streaming=True))
    response = qe.query(Q2)
    assert "chunk_hits" not in response.metadata
    text = "".join(response.response_gen)
    assert text.strip() and response.metadata["chunk_hits"] == 2 and response.metadata["chunk_misses"] == 0


async def test_epic_synthesizer_async_query(li_index):
    retriever = li_index.as_retriever(similarity_top_k=2)
    qe = RetrieverQueryEngine(retriever, response_synthesizer=EpicSynthesizer(llm=Settings.llm, max_tokens=8))
    response = await qe.aquery(Q1)
    assert response.response.strip() and response.metadata["chunk_misses"] == 0


def _chat_start(events) -> LLMChatStartEvent:
    starts = [e for e in events if isinstance(e, LLMChatStartEvent)]
    assert len(starts) == 1, [type(e).__name__ for e in events]
    return starts[0]


def _synth_engine(retriever, synth) -> RetrieverQueryEngine:
    return RetrieverQueryEngine(retriever, response_synthesizer=synth)


def test_epic_synthesizer_call_emits_the_llms_chat_events_with_its_question_and_chunks(smol_engine, li_index, events):
    llm = EpicLLM(engine=smol_engine, max_tokens=8)
    response = _synth_engine(li_index.as_retriever(similarity_top_k=2), EpicSynthesizer(llm=llm)).query(Q1)
    start, end = _chat_start(events), _chat_end(events)
    assert start.span_id == end.span_id and start.messages[-1].content == Q1
    assert start.additional_kwargs["chunks"] == [node_llm_text(n.node) for n in response.source_nodes]
    assert end.response.message.content == response.response
    stats = end.response.additional_kwargs
    assert stats["chunk_hits"] == 2 and stats["chunk_misses"] == 0 and stats["linked_tokens"] > 0
    assert {k: response.metadata[k] for k in STAT_KEYS} == {k: stats[k] for k in STAT_KEYS}


def test_token_counting_handler_counts_epic_synthesizer_calls_from_the_engines_usage(smol_engine, li_index, events):
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler

    counter = TokenCountingHandler(tokenizer=lambda s: [0] * 100000)  # would be wildly off if used
    llm = EpicLLM(engine=smol_engine, max_tokens=8)  # its own: the synthesizer sets its callback manager
    synth = EpicSynthesizer(llm=llm, callback_manager=CallbackManager([counter]))
    response = _synth_engine(li_index.as_retriever(similarity_top_k=2), synth).query(Q2)
    usage = _chat_end(events).response.raw["usage"]
    assert usage["prompt_tokens"] == response.metadata["prompt_tokens"] > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] == response.metadata["linked_tokens"] > 0
    assert len(counter.llm_token_counts) == 1
    assert counter.prompt_llm_token_count == usage["prompt_tokens"]
    assert counter.completion_llm_token_count == usage["completion_tokens"] == response.metadata["completion_tokens"]
    assert usage["completion_tokens"] > 0


def _span_name(span_id: str | None) -> str | None:
    return None if span_id is None else span_id.rsplit("-", 5)[0]  # "<Class>.<method>-<uuid4>"


def test_epic_synthesizer_spans_nest_synthesize_get_response_and_the_llm_chat_as_a_stock_synthesizer(
    smol_engine, li_index
):
    with caught() as (_, spans):
        llm = EpicLLM(engine=smol_engine, max_tokens=4)
        _synth_engine(li_index.as_retriever(similarity_top_k=2), EpicSynthesizer(llm=llm)).query(Q1)
    by_name: dict[str, list] = {}
    for s in spans.completed_spans:
        by_name.setdefault(_span_name(s.id_), []).append(s)
    (synth,) = by_name["EpicSynthesizer.synthesize"]  # one, as BaseSynthesizer.synthesize makes it
    (get,) = by_name["EpicSynthesizer.get_response"]
    (chat,) = by_name["EpicLLM.chat"]
    assert get.parent_id == synth.id_ and chat.parent_id == get.id_
    assert _span_name(synth.parent_id) == "RetrieverQueryEngine._query"


def test_epic_synthesizer_stream_emits_in_progress_events_then_the_end_event_with_usage(smol_engine, li_index, events):
    synth = EpicSynthesizer(llm=EpicLLM(engine=smol_engine, max_tokens=8), streaming=True)
    response = _synth_engine(li_index.as_retriever(similarity_top_k=2), synth).query(Q2)
    assert isinstance(response, StreamingResponse)
    assert not any(isinstance(e, LLMChatEndEvent) for e in events)  # not before the stream ends
    text = "".join(response.response_gen)
    progress = [e for e in events if isinstance(e, LLMChatInProgressEvent)]
    assert progress and progress[-1].response.message.content == text
    end = _chat_end(events)
    assert end.response.raw["usage"]["completion_tokens"] == response.metadata["completion_tokens"] > 0
    assert end.response.additional_kwargs["chunk_hits"] == response.metadata["chunk_hits"] == 2


async def test_epic_synthesizer_async_query_and_stream_emit_the_llms_chat_events(smol_engine, li_index, events):
    retriever = li_index.as_retriever(similarity_top_k=2)
    llm = EpicLLM(engine=smol_engine, max_tokens=6)
    response = await _synth_engine(retriever, EpicSynthesizer(llm=llm)).aquery(Q1)
    end = _chat_end(events)
    assert end.response.message.content == response.response and _chat_start(events).span_id == end.span_id
    assert response.metadata["chunk_hits"] == end.response.additional_kwargs["chunk_hits"] == 2
    events.clear()
    streamed = await _synth_engine(retriever, EpicSynthesizer(llm=llm, streaming=True)).aquery(Q2)
    text = "".join([t async for t in streamed.async_response_gen()])
    end = _chat_end(events)
    assert end.response.message.content == text and streamed.metadata["chunk_hits"] == 2
    assert any(isinstance(e, LLMChatInProgressEvent) for e in events)


def test_epic_llm_metadata_reports_the_engine(smol_engine):
    md = EpicLLM(engine=smol_engine, max_tokens=40).metadata
    assert md.context_window == smol_engine.max_model_len == 8192
    assert md.num_output == 40 and md.is_chat_model and md.model_name == "smollm2-135m-instruct"


def test_epic_llm_complete_chat_and_streams_carry_linking_figures(smol_engine, events):
    llm = EpicLLM(engine=smol_engine, max_tokens=6)
    r = llm.complete("Name a colour.")
    assert r.text and set(STAT_KEYS) <= set(r.additional_kwargs)
    last = list(llm.stream_complete("Name a colour.", max_tokens=4))[-1]
    assert last.additional_kwargs["policy"] == "legolink-16"
    c = llm.chat([ChatMessage(role="user", content="Say hello.")], temperature=0.0)
    assert c.message.content and c.additional_kwargs["prompt_tokens"] > 0
    parts = list(llm.stream_chat([ChatMessage(role="user", content="Say hello.")]))
    assert parts[-1].message.content == "".join(p.delta for p in parts)
    assert any(isinstance(e, LLMCompletionEndEvent) for e in events)
    assert sum(isinstance(e, LLMChatEndEvent) for e in events) == 2


async def test_epic_llm_async_forms(smol_engine):
    llm = EpicLLM(engine=smol_engine, max_tokens=4)
    r = await llm.acomplete("Name a colour.")
    assert r.additional_kwargs["completion_tokens"] > 0
    gen = await llm.astream_chat([ChatMessage(role="user", content="Say hello.")])
    parts = [p async for p in gen]
    assert parts and "ttft_s" in parts[-1].additional_kwargs
    c = await llm.achat([ChatMessage(role="user", content="Say hello.")])
    assert c.message.content
    gen = await llm.astream_complete("Name a colour.")
    assert "ttft_s" in [p async for p in gen][-1].additional_kwargs


LIGHTHOUSE = {
    "orrin#0": "The Orrin lighthouse was built in 1874 on the Kestrel cliffs; its lamp is visible for 19 miles.",
    "orrin#1": "Keepers of the Orrin lighthouse served four-year terms and logged every passing ship by hand.",
    "mill#0": "The Dunmore windmill ground barley until 1952 and now houses a small museum of farm tools.",
}


def test_persisted_index_loaded_from_storage_links_through_the_node_compiler(smol_engine, li_index, events, tmp_path):
    # An index built and persisted without EpicChunkCompiler (elsewhere, or before a restart): its texts
    # were never compiled in this process, so only the retrieval-time compiler makes them link.
    nodes = [TextNode(text=t, id_=k) for k, t in LIGHTHOUSE.items()]
    VectorStoreIndex(nodes).storage_context.persist(persist_dir=str(tmp_path))  # Settings.embed_model: MiniLM
    loaded = load_index_from_storage(StorageContext.from_defaults(persist_dir=str(tmp_path)))
    assert not any(node_llm_text(n) in smol_engine.text_index for n in nodes)
    qe = loaded.as_query_engine(similarity_top_k=2, node_postprocessors=[EpicNodeCompiler(engine=smol_engine)])
    first = qe.query("When was the Orrin lighthouse built?")
    stats = _chat_end(events).response.additional_kwargs
    assert {n.node.node_id for n in first.source_nodes} == {"orrin#0", "orrin#1"}
    assert stats["chunk_hits"] == 2 and stats["chunk_misses"] == 0 and stats["linked_tokens"] > 0
    events.clear()
    second = qe.query("How long did Orrin lighthouse keepers serve?")
    stats = _chat_end(events).response.additional_kwargs
    assert {n.node.node_id for n in second.source_nodes} == {"orrin#0", "orrin#1"}
    assert stats["chunk_hits"] == 2 and stats["chunk_misses"] == 0
