"""EpicConnector's options: the keys of vLLM's `kv_connector_extra_config`, checked at start-up.

EpicEngine sets `local` (or `store`), `workspace_tokens`, `async_links` and `link_step_share` from its
EngineConfig; under `vllm serve` they are given by hand:

    --kv-transfer-config '{"kv_connector": "EpicConnector", "kv_connector_module_path": "epic_rag.engine.connector",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"store": "memory", ...}}'

A key not listed here is refused by name (a misspelt option never silently falls back to its default).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ...keys import DEFAULT_TENANT
from ...policy import Policy, parse_policy
from ..jobs import MAX_SPANS
from .tenancy import Tenancy

# A client compile's record holds at most this many tokens by default: a RAG chunk is far shorter, and one
# request can no longer put a whole context window of KV (~1 GB at 8k tokens of an 8B model) in the shared store.
DEFAULT_MAX_COMPILE_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The connector's options (`kv_connector_extra_config`), each with its default.

    Attributes:
        store: the chunk store spec the worker side opens (stores.py; e.g. "memory+redis://host:6379/0"). Give
            its HMAC secret by `$EPIC_RAG_KV_SECRET`, not in the spec: vLLM logs its config as it is.
        local: set by an EpicEngine whose engine core runs in its process: the handle of its own store objects
            (stores.register_local), used instead of `store`; never set by hand.
        workspace_tokens: prompt tokens one batched link pass holds (sizes the linker's buffers); None: twice
            `max_model_len` (link/memory.py: workspace_tokens).
        async_links: link off the decode path (a share of each step, while the request waits); always off under
            tensor parallelism.
        link_step_share: at most this many times a step's forward time is spent linking in that step (then at
            least one layer); >= 0.
        find_chunks: a policy name: requests that name no spans have their tenant's compiled chunks found in
            their tokens and linked under it (finder.py); None: they are not looked at.
        max_spans: spans one link may name (each record is read once however many spans name it).
        tenant: the namespace of requests that send no `cache_salt` (tenancy.py).
        allow_client_compiles: False: compile requests are refused; the server links records compiled elsewhere.
        max_compile_tokens: the most tokens one compile may store (its record: the sink and the chunk, or a bare
            compile's prompt); a longer one fails with a clear error before anything is captured (counted in
            epic_rag_compile_refusals_total). None: no bound (an EpicEngine's own compiles). What a tenant may
            keep in the store is bounded by the store spec's tenant_max_bytes / tenant_max_entries.
        allow_client_find: whether a request may switch the finder on or pick its policy (`{"find": false}` is
            always accepted).
    """

    store: str = "memory"
    local: str | None = None
    workspace_tokens: int | None = None
    async_links: bool = True
    link_step_share: float = 1.0
    find_chunks: str | None = None
    max_spans: int = MAX_SPANS
    tenant: str = DEFAULT_TENANT
    allow_client_compiles: bool = True
    max_compile_tokens: int | None = DEFAULT_MAX_COMPILE_TOKENS
    allow_client_find: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """The options from `kv_connector_extra_config`; ValueError naming an unknown or malformed one."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown option(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**extra)
        cfg.tenancy  # noqa: B018 (checks tenant and the allow_* flags)
        if not isinstance(cfg.async_links, bool):
            raise ValueError(f"async_links must be true or false, got {cfg.async_links!r}")
        if not isinstance(cfg.link_step_share, (int, float)) or not cfg.link_step_share >= 0:
            raise ValueError(f"link_step_share must be a number >= 0, got {cfg.link_step_share!r}")
        mct = cfg.max_compile_tokens
        if mct is not None and (not isinstance(mct, int) or isinstance(mct, bool) or mct < 1):
            raise ValueError(f"max_compile_tokens must be an integer >= 1 or null (no bound), got {mct!r}")
        if not isinstance(cfg.max_spans, int) or cfg.max_spans < 1:
            raise ValueError(f"max_spans must be an integer >= 1, got {cfg.max_spans!r}")
        if cfg.workspace_tokens is not None and (not isinstance(cfg.workspace_tokens, int) or cfg.workspace_tokens < 1):
            raise ValueError(f"workspace_tokens must be an integer >= 1, got {cfg.workspace_tokens!r}")
        cfg.find_policy  # noqa: B018 (an unknown policy name is refused at start-up)
        return cfg

    @property
    def tenancy(self) -> Tenancy:
        """Tenants, and what clients may ask (tenancy.py)."""
        return Tenancy.from_extra(
            {
                "tenant": self.tenant,
                "allow_client_compiles": self.allow_client_compiles,
                "allow_client_find": self.allow_client_find,
            }
        )

    @property
    def find_policy(self) -> Policy | None:
        """The finder's policy (find_chunks), or None when it is off."""
        if not self.find_chunks:
            return None
        pol = parse_policy(self.find_chunks)
        if not pol.links_chunks or pol.kind == "auto":  # auto needs EpicEngine's refined records
            raise ValueError(
                f"find_chunks must name a link policy (naive, legolink-<k>, query-<r>...), got {pol.name!r}"
            )
        return pol
