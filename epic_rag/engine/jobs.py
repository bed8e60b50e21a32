"""What a request asks the connector to do, as plain data that travels inside the request.

vLLM carries a request's `kv_transfer_params` from the client (EpicEngine, or any client of `vllm serve`)
to the scheduler-side connector, in whatever process the engine core runs; nothing is shared by reference.
Two forms, under the "epic" key:

- a link: {"link": {"policy": "legolink-16", "sink": 1, "spans": [[key, offset, start, n, exact], ...],
  "on_missing": "recompute"}}: tokens [offset, offset + n) of the stored record `key` sit at prompt positions
  [start, start + n); `exact` marks a leading prefix compiled at position 0 (never recomputed; read from the
  glue store). Exactness is proven, never taken from the client: only a span at record offset 0 and prompt
  position 0 is exact (a glue record is computed bare from position 0, so its first n tokens' KV is what a
  plain prefill of the prompt computes); any other span marked exact is linked as an approximate chunk span
  (read from the chunk store, scoped, recomputed where missing), whatever the client wrote. The first `claim`
  prompt tokens (up to the last span's end, never the prompt's last token) are linked by the worker, which
  reads the records from its own store; vLLM computes the rest. A span whose record is missing or does not
  hold the prompt's tokens is recomputed ("recompute", the default: exact, only slower) or fails the request
  ("fail": EpicEngine's choice, which then checks its chunks and retries).
- a compile: {"compile": {"lead": n, "key": key, "glue": false}}: the prompt is a compile lead of n tokens
  and a chunk; the worker copies the sink's and the chunk's KV out of the pages as the prefill runs and stores
  the record once the prompt is complete, under the key the worker derives itself from its model fingerprint,
  the request's tenant (tenancy.py), the whole lead and the chunk's tokens (keys.py). `key` is optional: a
  client that computed the key (EpicEngine) names it, and a compile whose key differs from the derived one is
  refused, nothing stored. Glue (`glue: true`: a leading prefix, stored in the worker's private glue store) is
  compiled bare: lead 0.

The worker's outcome comes back in the finished request's kv_transfer_params (connector.request_finished):
{"epic": {"stored": key}} or {"epic": {"error": why}} for a compile (a compile generates 2 tokens so that its
outcome is known when it ends), {"epic": {"recomputed": n, "linked_spans": n, "missing": [keys]}} for a link
that outlived its first step. A link names at most MAX_SPANS spans (kv_connector_extra_config "max_spans").
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ..keys import key_of, lead_id
from ..policy import Policy, parse_policy
from ..store import ChunkKV
from ..store.base import check_key

MAX_SPANS = 512  # spans one link may name: each is checked and sliced on the worker (records are read once)

# The fields each object may hold: any other is refused by name (a misspelt field never falls back silently;
# review D: {"leed": 3} became a bare compile into the shared store).
EPIC_FIELDS = ("link", "compile", "find")
LINK_FIELDS = ("policy", "sink", "spans", "on_missing")
COMPILE_FIELDS = ("lead", "key", "glue")

# Client values quoted in errors: bounded in length and depth (a value nested thousands deep made repr raise
# RecursionError while the error was being written).
_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxlist, _repr.maxdict, _repr.maxstring, _repr.maxother = 3, 6, 6, 60, 60
_quote = _repr.repr


def _only(what: str, p: dict, valid: tuple[str, ...]) -> None:
    """ValueError naming the fields of `p` not in `valid`, and the valid ones."""
    unknown = [k for k in p if k not in valid]
    if unknown:
        names = ", ".join(_quote(k) for k in unknown[:8])
        raise ValueError(f"{what}: unknown field(s) {names}; valid: {', '.join(valid)}")


@dataclass(frozen=True, slots=True)
class SpanRef:
    """Tokens [offset, offset + n) of the record `key`, linked at prompt positions [start, start + n)."""

    key: str
    offset: int
    start: int
    n: int
    exact: bool = False  # a leading prefix compiled at position 0: exact, never recomputed

    @property
    def end(self) -> int:
        return self.start + self.n

    def proven(self) -> SpanRef:
        """This span with `exact` kept only where it is provably exact: record offset 0 at prompt position 0
        (nothing before it in either). A glue record's tokens [k, k + n) were computed behind its first k
        tokens, which a prompt placing them at k need not hold (review A: hidden text H before visible V, V
        linked at offset len(H) as "exact", its blocks served as V's exact prefix-cache blocks)."""
        if self.exact and (self.offset != 0 or self.start != 0):
            return SpanRef(self.key, self.offset, self.start, self.n, False)
        return self


@dataclass(frozen=True, slots=True)
class LinkRequest:
    """A link as it travels in kv_transfer_params."""

    policy: Policy
    sink: int | None  # the compile lead's first token: every chunk record must start with it
    spans: tuple[SpanRef, ...]
    on_missing: str = "recompute"  # or "fail" (see the module docstring)

    def claim(self, num_prompt: int) -> int:
        """Leading prompt tokens the connector provides: up to the last span's end, always leaving the
        prompt's last token for vLLM to compute (it yields the first logits)."""
        return min(max(s.end for s in self.spans), num_prompt - 1)

    def claimed(self, num_prompt: int) -> tuple[int, tuple[SpanRef, ...]]:
        """The claim and the spans inside it (a span cut by the claim is truncated to the claimed part)."""
        c = self.claim(num_prompt)
        spans = tuple(
            SpanRef(s.key, s.offset, s.start, min(s.n, c - s.start), s.exact) for s in self.spans if s.start < c
        )
        return c, spans

    def cut(self, num_prompt: int) -> tuple[int, LinkRequest]:
        """The claim and this link with its spans cut to it."""
        c, spans = self.claimed(num_prompt)
        return c, LinkRequest(self.policy, self.sink, spans, self.on_missing)

    def approximate_from(self) -> int | None:
        """The first prompt position whose KV the link may make approximate: the first chunk span's start
        (before it, exact spans and computed tokens see exact KV only); None when every span is exact."""
        return min((s.start for s in self.spans if not s.exact), default=None)

    def scope(self) -> bytes:
        """The prefix-cache scope of the blocks this link fills from approximate_from() on: the policy, the
        sink and the spans (their keys are content-derived: model, tokenizer, KV dtype, tenant, tokens). A later
        request linking the same records at the same places under the same policy (a follow-up turn over the
        same chunks) finds them; no exact prompt and no other link does."""
        return json.dumps(["epic-link", self.policy.name, self.sink, self._span_rows()]).encode()

    def _span_rows(self) -> list[list]:
        return [[s.key, s.offset, s.start, s.n, s.exact] for s in self.spans]

    def to_params(self) -> dict[str, Any]:
        link = {
            "policy": self.policy.name,
            "sink": self.sink,
            "spans": self._span_rows(),
            "on_missing": self.on_missing,
        }
        return {"epic": {"link": link}}

    @classmethod
    def from_params(cls, p: Any, num_prompt: int, max_spans: int = MAX_SPANS) -> LinkRequest:
        """Parse and check a link (the "link" value); raises ValueError naming what is wrong. Spans must be
        in prompt order, disjoint and inside the prompt, and at most `max_spans`."""
        if not isinstance(p, dict):
            raise ValueError(f"epic link: expected an object with fields {', '.join(LINK_FIELDS)}")
        _only("epic link", p, LINK_FIELDS)
        policy = parse_policy(p.get("policy", ""))
        if policy.kind == "auto":  # it depends on the engine's refined records, which a link does not name
            raise ValueError("epic link: 'auto' is resolved per request by EpicEngine; name a link policy")
        if not policy.links_chunks:
            raise ValueError(f"epic link: policy {policy.name} links no chunks")
        sink = p.get("sink")
        if sink is not None and (not isinstance(sink, int) or isinstance(sink, bool) or sink < 0):
            raise ValueError("epic link: sink must be a token id")
        raw = p.get("spans")
        if not isinstance(raw, list) or not raw:
            raise ValueError("epic link: spans must be a non-empty list")
        if len(raw) > max_spans:  # refused before any span is looked at
            raise ValueError(f"epic link: {len(raw)} spans, more than this server's limit of {max_spans}")
        spans, end = [], 0
        for s in raw:
            ok = isinstance(s, (list, tuple)) and len(s) == 5 and isinstance(s[0], str)
            ok = ok and all(isinstance(x, int) and not isinstance(x, bool) for x in s[1:4]) and isinstance(s[4], bool)
            if not ok:
                raise ValueError(f"epic link: a span is [key, offset, start, n, exact], got {_quote(s)}")
            check_key(s[0])  # names a file or a Redis key: refused here, never looked up
            span = SpanRef(*s).proven()
            if span.offset < 0 or span.n < 1 or span.start < end:
                raise ValueError(f"epic link: span {_quote(s)} overlaps the one before or is empty")
            end = span.end
            spans.append(span)
        if end > num_prompt:
            raise ValueError(f"epic link: spans reach position {end}, past the prompt's {num_prompt} tokens")
        if num_prompt < 2:
            raise ValueError("epic link: the prompt needs a token after the linked ones")
        on_missing = p.get("on_missing", "recompute")
        if on_missing not in ("recompute", "fail"):
            raise ValueError(f"epic link: on_missing must be 'recompute' or 'fail', got {_quote(on_missing)}")
        return cls(policy, sink, tuple(spans), on_missing)


@dataclass(frozen=True, slots=True)
class CompileRequest:
    """A compile as it travels in kv_transfer_params."""

    key: str | None  # the key the client expects (None: whatever the worker derives, key_for)
    lead: int  # prompt tokens before the chunk (the sink first); 0 for glue and other bare compiles
    glue: bool = False  # stored in the worker's glue store (client-controlled prefixes) instead of the chunk store

    def to_params(self) -> dict[str, Any]:
        return {"epic": {"compile": {"key": self.key, "lead": self.lead, "glue": self.glue}}}

    @classmethod
    def from_params(cls, p: Any, num_prompt: int) -> CompileRequest:
        key = p.get("key") if isinstance(p, dict) else None
        if not isinstance(p, dict) or not (key is None or (isinstance(key, str) and key)):
            raise ValueError("epic compile: expected {'lead': int, 'key': str (optional), 'glue': bool (optional)}")
        _only("epic compile", p, COMPILE_FIELDS)
        lead, glue = p.get("lead", 0), p.get("glue", False)
        if not isinstance(lead, int) or isinstance(lead, bool) or not 0 <= lead < num_prompt:
            raise ValueError(f"epic compile: lead must be an int in [0, {num_prompt}), got {_quote(lead)}")
        if not isinstance(glue, bool):
            raise ValueError("epic compile: glue must be a boolean")
        if glue and lead:  # glue sits at position 0 with nothing before it: its KV must be computed bare
            raise ValueError(f"epic compile: glue is compiled bare (lead 0), got lead {lead}")
        if key is not None:
            check_key(key)
        return cls(key, lead, glue)

    def key_for(self, fingerprint: str, tenant: str, prompt: list[int]) -> str:
        """The record's key, derived here from the fingerprint, the tenant id, the whole lead and the record's
        tokens; ValueError when the client named another (nothing is stored under a key it chose)."""
        key = key_of(fingerprint, tenant, self.lead_of(prompt), self.record_tokens(prompt))
        if self.key is not None and self.key != key:
            raise ValueError(
                f"epic compile: key {self.key!r} is not the key of this tenant, lead and chunk "
                "(the server derives keys; leave 'key' out)"
            )
        return key

    def lead_of(self, prompt: list[int]) -> str:
        """The id of the lead the chunk's KV is computed behind (keys.lead_id; "" for a bare compile)."""
        return lead_id(prompt[: self.lead])

    def record_tokens(self, prompt: list[int]) -> list[int]:
        """The record's tokens: the lead's first token (the sink) and the chunk; a bare compile's prompt."""
        return prompt[:1] + prompt[self.lead :] if self.lead > 1 else list(prompt)


def epic_params(kv_transfer_params: Any) -> dict[str, Any] | None:
    """The "epic" part of a request's kv_transfer_params: None when there is none; ValueError when it is not an
    object, names a field not in EPIC_FIELDS, or names more than one of them (a link with a find would have
    run the find)."""
    p = kv_transfer_params if isinstance(kv_transfer_params, dict) else {}
    if "epic" not in p:
        return None
    e = p["epic"]
    if not isinstance(e, dict):
        raise ValueError(f"epic: expected an object with one of {', '.join(EPIC_FIELDS)}, got {type(e).__name__}")
    _only("epic", e, EPIC_FIELDS)
    named = [f for f in EPIC_FIELDS if f in e]
    if len(named) != 1:
        raise ValueError(f"epic: expected exactly one of {', '.join(EPIC_FIELDS)}, got {', '.join(named) or 'none'}")
    return e


# ---------------------------------------------------------------- worker side


@dataclass(slots=True)
class LinkSpan:
    start: int  # first prompt position of the chunk
    kv: ChunkKV
    exact: bool = False  # KV already exact here (a leading prefix compiled at position 0): never recomputed


@dataclass(slots=True)
class LinkJob:
    """One request's link on the worker: the claimed prompt tokens and the spans whose KV was found."""

    token_ids: list[int]  # prompt[:claim]
    spans: list[LinkSpan]
    policy: Policy
    recomputed: int = 0  # filled by the linker: tokens recomputed in the last layer
    error: str | None = None
    tail: list[int] = field(default_factory=list)  # prompt[claim:] (question, template): query-<r>'s probe

    def initial_recompute(self) -> torch.Tensor:
        """Sorted positions recomputed from layer 0 on.  # -> [nR] int64"""
        return initial_recompute(len(self.token_ids), self._extents(), self.policy)

    def masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cached, candidate): positions with cached KV, and those a blend may choose to recompute."""
        return masks(len(self.token_ids), self._extents())

    def _extents(self) -> list[tuple[int, int, bool]]:
        return [(s.start, s.kv.num_tokens, s.exact) for s in self.spans]


def masks(T: int, extents: list[tuple[int, int, bool]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cached, candidate) for spans given as (start, n, exact).  # -> [T] bool, [T] bool"""
    cached = torch.zeros(T, dtype=torch.bool)
    candidate = torch.zeros(T, dtype=torch.bool)
    for start, n, exact in extents:
        cached[start : start + n] = True
        candidate[start : start + n] = not exact
    return cached, candidate


def initial_recompute(T: int, extents: list[tuple[int, int, bool]], policy: Policy) -> torch.Tensor:
    """Sorted positions recomputed from layer 0 on (query-<r>: in its probe pass).  # -> [nR] int64"""
    if policy.kind == "cacheblend":
        return torch.arange(T)
    cached, _ = masks(T, extents)
    head = torch.zeros(T, dtype=torch.bool)
    if policy.kind == "legolink":
        for start, n, exact in extents:
            if not exact:
                head[start : start + min(policy.k, n)] = True
    return torch.nonzero(~cached | head).flatten()


def planned_recompute(T: int, extents: list[tuple[int, int, bool]], policy: Policy) -> int:
    """Tokens a link of these spans recomputes in its last layer when every record is found (the linker's
    count: CacheBlend and query-<r> keep every uncached token and round(ratio x candidates) of the chunk
    tokens)."""
    if policy.kind not in ("cacheblend", "query"):
        return len(initial_recompute(T, extents, policy))
    cached, candidate = masks(T, extents)
    return int((~cached).sum()) + int(round(policy.ratio * int(candidate.sum())))


@dataclass(slots=True)
class Capture:
    """KV being captured from a compile request whose prompt is [lead] + chunk: k, v: [L, 1 + n, Hkv, D] keep
    the lead's first token (the sink) and the chunk. The rest of the lead is shared glue, not stored. The
    sink's key is moved to position lead-1, right before the chunk, so the record is one contiguous run
    (a first token's KV does not depend on its position except through the key's rotation)."""

    k: torch.Tensor
    v: torch.Tensor
    lead: int = 1  # prompt tokens before the chunk (sink included)
    filled_to: int = 0  # prompt positions captured so far
    error: str | None = None
    landed: list = field(default_factory=list)  # on a GPU: an event per capture step, complete once it landed

    def kept(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """The kept parts of prompt positions [start, end): (first, stop, buffer index of first)."""
        if self.lead <= 1:
            return [(start, end, start)] if end > start else []
        out = [(start, min(end, 1), start)] if start < 1 else []
        first = max(start, self.lead)
        if first < end:
            out.append((first, end, first - self.lead + 1))
        return [r for r in out if r[1] > r[0]]
