"""Tenants of one server: which records, finder entries and glue a request may see, and what it may ask.

The clients of a `vllm serve` process (and every replica sharing its Redis) share one chunk store. Each
record is scoped by a tenant namespace: its key commits to the namespace's id and the record carries that id
(keys.py), so a request links and finds only its own tenant's records; another tenant's key reads as missing,
exactly as a key nobody compiled does. A request's namespace is the part of its vLLM `cache_salt` before the
first ":" (all of it when there is none); a request without a salt, or with an empty part, is in the
server's default namespace (kv_connector_extra_config "tenant", default ""). One secret per tenant (a gateway
setting cache_salt from the caller's API key does it) thus isolates both vLLM's own prefix cache and the chunk
store. Within a tenant, requests may share one salt: linked KV is never cached as exact blocks (a link's blocks
are scoped to the link, connector/scheduler.py on_new_request); "<tenant>:<unique>" keeps a request out of every
prefix-cache hit (what `full` does, a baseline that reuses nothing).

Server options (kv_connector_extra_config), checked at start-up:
- "tenant": the default namespace (a string, default "").
- "allow_client_compiles" (default true): whether requests may compile. Off: the server only links records
  compiled elsewhere (an EpicEngine fleet sharing the store, in the default namespace).
- "allow_client_find" (default false): whether a request may switch the chunk finder on or pick its policy
  ({"epic": {"find": policy}}); {"find": false} (off) is always accepted.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ...keys import DEFAULT_TENANT, tenant_id

SEP = ":"  # cache_salt = "<tenant namespace>:<anything>" (vLLM refuses salts holding "/", "@", "\\")


def namespace_of(cache_salt: str | None, default: str = DEFAULT_TENANT) -> str:
    """A request's tenant namespace from its cache_salt (see the module docstring)."""
    if not cache_salt:
        return default
    return cache_salt.partition(SEP)[0] or default


def shared_salt(namespace: str = DEFAULT_TENANT, name: str = "shared") -> str:
    """A cache_salt the requests of a tenant that use it share (`name`: "shared", what an EpicEngine's requests
    use unless they name another): exact blocks (templates, system prompts, compile leads, exact repeats) and a
    link's blocks in its own scope are reused between them."""
    return f"{namespace}{SEP}{name}"


def unique_salt(namespace: str = DEFAULT_TENANT) -> str:
    """A cache_salt in `namespace` that no other request shares (no prefix-cache hit between requests)."""
    return f"{namespace}{SEP}{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class Tenancy:
    default: str = DEFAULT_TENANT
    allow_client_compiles: bool = True
    allow_client_find: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> Tenancy:
        """The options from kv_connector_extra_config; ValueError naming a malformed one."""
        default = extra.get("tenant", DEFAULT_TENANT)
        if not isinstance(default, str) or SEP in default:
            raise ValueError(f"kv_connector_extra_config 'tenant' must be a string without '{SEP}', got {default!r}")
        flags = {}
        for name, value in (("allow_client_compiles", True), ("allow_client_find", False)):
            flags[name] = extra.get(name, value)
            if not isinstance(flags[name], bool):
                raise ValueError(f"kv_connector_extra_config {name!r} must be true or false, got {flags[name]!r}")
        return cls(default, **flags)

    def of(self, request) -> str:
        """The tenant id (keys.tenant_id) of a vLLM request."""
        return tenant_id(namespace_of(getattr(request, "cache_salt", None), self.default))
