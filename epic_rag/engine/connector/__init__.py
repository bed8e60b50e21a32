"""vLLM's connector hooks: EpicConnector, the class vLLM loads (`kv_connector_module_path`
"epic_rag.engine.connector"), its scheduler side (scheduler.py) and worker side (worker.py), what crosses
between them (meta.py), its options (config.py), the chunk finder, tenants and the start-up refusals.

The connector's classes load on first use (vLLM's loader and `worker_extension_cls` read them as attributes of
this package): the light modules here (tenancy, config) import without vLLM."""

__all__ = ["EpicConnector", "EpicWorkerExtension", "pending"]


def __getattr__(name: str):
    if name in __all__:
        from . import epic

        return getattr(epic, name)
    raise AttributeError(name)
