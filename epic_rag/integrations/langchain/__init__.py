"""LangChain integration: `ChatEpic` (a chat model) and `create_epic_rag_chain` (retriever -> engine).

- `ChatEpic` renders messages through the model's chat template; compiled chunk texts found in the result
  (e.g. documents a `create_stuff_documents_chain` prompt inserted) are linked from cache. Passing
  `chunks=[...]` (texts, ChunkRefs or Documents) per call, e.g. `model.invoke(question, chunks=docs)`,
  hands them to the engine explicitly as a RagRequest instead.
- `EpicDocumentCompiler()` is a pass-through Runnable compiling Documents' page_content at query time:
  `retriever | EpicDocumentCompiler()` links documents from a store loaded from disk or one that keeps its
  own text. Texts already compiled in this process cost nothing; texts in the chunk store a store lookup.
- `create_epic_rag_chain(retriever, ...)` is a Runnable: question -> retriever -> engine, with the retrieved
  Documents passed as chunks (no prompt matching); invoke/stream/batch and their async forms.

`AIMessage.response_metadata` carries model_name, finish_reason, `token_usage` (OpenAI-shaped, as ChatOpenAI:
prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details.cached_tokens) and the linking figures
(ttft_s, total_s, prompt_tokens, linked_tokens, recomputed_tokens, chunk_hits, chunk_misses, policy,
completion_tokens, chunk_keys); `usage_metadata` counts linked prompt tokens as `input_token_details.cache_read`;
with `logprobs=True` (and `top_logprobs=k`), `response_metadata["logprobs"] = {"content": [...]}` as ChatOpenAI.
For streams they arrive on the last chunk.

Sampling options (top_p, top_k, min_p, seed, presence_penalty, frequency_penalty, repetition_penalty,
logprobs/top_logprobs) are fields, `model_kwargs` entries or per-call keywords; an unknown one is an error
naming it, never dropped.
"""

from .chain import EpicRagChain, create_epic_rag_chain
from .chat_model import ChatEpic
from .compilers import EpicDocumentCompiler, compile_documents

__all__ = ["ChatEpic", "EpicDocumentCompiler", "EpicRagChain", "compile_documents", "create_epic_rag_chain"]
