"""Framework integrations (import the submodule you need; each needs its extra installed):

- `epic_rag.integrations.llamaindex`: EpicLLM, EpicChunkCompiler, EpicNodeCompiler, EpicSynthesizer (extra: llamaindex)
- `epic_rag.integrations.langchain`: ChatEpic, EpicDocumentCompiler, create_epic_rag_chain (extra: langchain)

All wrappers share one engine per process (see `set_shared_engine` / `shared_engine`).
"""

from ._shared import (
    STAT_KEYS,
    adopt_engine,
    generation_stats,
    openai_logprobs,
    openai_token_logprob,
    set_shared_engine,
    shared_engine,
    usage_of,
)

__all__ = [
    "STAT_KEYS",
    "adopt_engine",
    "generation_stats",
    "openai_logprobs",
    "openai_token_logprob",
    "set_shared_engine",
    "shared_engine",
    "usage_of",
]
