"""LlamaIndex integration: a drop-in LLM, an ingestion transform that compiles chunks, a response synthesizer.

- `EpicLLM` (a CustomLLM). Set `Settings.llm = EpicLLM(...)` and a stock query engine links the retrieved
  nodes from cache: the engine finds the compiled chunk texts inside the prompt LlamaIndex renders (chat
  messages go through the model's chat template) and tokenizes each piece on its own.
- `EpicChunkCompiler` (a TransformComponent) compiles each node's LLM-visible text
  (`node.get_content(MetadataMode.LLM)`, metadata header included, stripped as response synthesis inserts
  it), so a corpus is compiled at ingest. Put it after every step that changes text or metadata.
- `EpicNodeCompiler` (a BaseNodePostprocessor) compiles the retrieved nodes' LLM-visible text at query time,
  so an index persisted elsewhere, a vector store that keeps its own text, or a pipeline whose docstore
  skipped unchanged documents still links: `index.as_query_engine(node_postprocessors=[EpicNodeCompiler()])`.
  Texts already compiled in this process cost nothing; texts already in the chunk store cost a store lookup.
- `EpicSynthesizer` (a BaseSynthesizer) hands the retrieved node texts to the engine as chunks of a
  RagRequest: no string matching; the linking figures land in `Response.metadata`. Its calls are
  `EpicLLM.chat(messages, chunks=[...])` (and the stream / async forms), so LlamaIndex's instrumentation
  (LLMChat* events, spans) and callback handlers (TokenCountingHandler) see them as any LLM call.

`EpicLLM.chat` and its stream / async forms take `chunks=[...]` (texts, ChunkRefs or nodes) per call, with
the messages as system messages and one user question: the chunks go to the engine as a RagRequest (and
`template=` is its user message, with `{context}` and `{question}` slots), as ChatEpic takes them.

Every response carries the figures in `additional_kwargs` (CompletionResponse / ChatResponse; for streams,
on the last item): ttft_s, total_s, prompt_tokens, linked_tokens, recomputed_tokens, chunk_hits,
chunk_misses, policy, finish_reason, completion_tokens, chunk_keys; and OpenAI-shaped token usage in
`raw["usage"]` (prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details.cached_tokens = linked
tokens), where LlamaIndex's `TokenCountingHandler` reads it. Sampling options (top_p, top_k, min_p, seed,
penalties, logprobs/top_logprobs) are fields, `additional_kwargs` entries or per-call keywords; an unknown
one is an error naming it.
"""

from .compilers import EpicChunkCompiler, EpicNodeCompiler
from .llm import EpicLLM, node_llm_text
from .synthesizer import DEFAULT_TEXT_QA_TEMPLATE, EpicSynthesizer

__all__ = [
    "DEFAULT_TEXT_QA_TEMPLATE",
    "EpicChunkCompiler",
    "EpicLLM",
    "EpicNodeCompiler",
    "EpicSynthesizer",
    "node_llm_text",
]
