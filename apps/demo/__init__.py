"""Demo chat app over a document corpus, with an OpenAI-compatible API (`epic-rag demo`).

Data path: corpus -> chunks -> MiniLM embeddings in FAISS (retrieval) and engine.compile (chunk KV in
the store) -> per question: top-k chunks as ChunkRefs -> EpicEngine.astream_events -> SSE.
"""

from .config import DemoConfig

__all__ = ["DemoConfig", "create_app"]


def __getattr__(name: str):
    if name == "create_app":  # FastAPI loads on demand: `import epic_rag_demo` stays cheap for the CLI
        from .server import create_app

        return create_app
    raise AttributeError(name)
