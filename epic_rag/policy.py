"""Link policies, parsed from strings such as "legolink-16", "legolink-epic-16" or "cacheblend-15".

Every linking policy links the same compiled form of a chunk, so a corpus compiled once serves them all:
the chunk compiled behind the compile lead (`prompt.compile_lead`: the default prompt up to its first
document), whose first token is the sink; the record keeps the sink's KV (moved next to the chunk) and the
chunk's. Policies differ in whether the sink stays in the prompt:
- kept (EPIC's reference form, also how EPIC's and CacheBlend's baselines compile chunks): the prompt holds
  [sink] + chunk per chunk; `legolink-epic-<k>` recomputes the first k of those tokens (k counts the sink),
  `naive` recomputes none, `cacheblend-<r>` blends them;
- dropped (EPIC's LegoLink-0 recipe): the prompt holds the chunk's own tokens, whose KV was computed against
  a real attention sink instead of making the chunk's first word the sink; `legolink-sink-<k>` recomputes
  the first k chunk tokens, `legolink-0` none.
`legolink-<k>` means the form named by DEFAULT_LEGOLINK_FORM (the better-measured one, docs/benchmarks.md).

`query-<r>` (query-aware linking, sink form) asks the question first: a probe pass runs the prompt's uncached
tokens and its tail (question, template) over the linked chunk KV, scores every chunk token by the attention
the question gives it, then recomputes the top r percent of chunk tokens (plus the uncached ones) through all
layers (linker.py).

`auto` (the default) is resolved per request by EpicEngine: legolink-16 where every chunk links a refined
record (neighbour-aware compile, EpicEngine.refine), else query-20.

Measured on the demo's model (Qwen2.5-Coder-0.5B, 150 paired gold-answer samples, docs/bench/qwen-query):
LegoLink-16 is no more accurate than naive there (56.0 vs 55.3 %, full 66.0 %): its fixed head recompute
cannot know which tokens the question needs; query-20 is 1.3 points below full at a fifth of its TTFT.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Kind = Literal["full", "prefix", "naive", "legolink", "cacheblend", "query", "auto"]
Form = Literal["epic", "sink"]

SINK_LEN = 1  # sink tokens kept in a chunk's record (the compile lead's first token)
DEFAULT_LEGOLINK_FORM: Form = "sink"
FAST_POLICY = "legolink-16"
# `auto`, resolved per request by the engine (EpicEngine.prepare): the fast link where every chunk of the prompt
# is linked in a refined form (EpicEngine.refine: its KV was computed behind its nearest chunks), else the
# query-aware one. On the test split (docs/bench/qwen-refine) legolink-16 over refined chunks answers as full
# does at a fraction of query-20's TTFT; over chunks compiled alone query-20 is the closest to full.
AUTO_POLICY = "auto"
AUTO_REFINED, AUTO_PLAIN = FAST_POLICY, "query-20"
# ... and where its look-alike guard (engine/guard.py) finds the question's key and a near twin of it in two
# linked chunks, where every link loses to full, exact KV: vLLM's prefix caching, a full prefill of what its
# cache lacks (a conversation's earlier turns and the template stay cached, unlike `full`, which reuses nothing).
AUTO_ESCALATED = "prefix"
# The engine's (and so the integrations' and the demo's) default.
DEFAULT_POLICY = AUTO_POLICY


@dataclass(frozen=True, slots=True)
class Policy:
    """A parsed link policy (parse_policy).

    Attributes:
        name: as given, lower-cased ("legolink-16").
        kind: full, prefix, naive, legolink, cacheblend or query.
        k: legolink: tokens recomputed at the head of each chunk's span.
        ratio: cacheblend, query: fraction of chunk tokens recomputed (after the check layer / the probe).
        form: legolink, query: which compiled form it links, "epic" (the sink kept) or "sink" (the sink
            dropped; see the module docstring).
    """

    name: str
    kind: Kind
    k: int = 0
    ratio: float = 0.0
    form: Form | None = None

    @property
    def links_chunks(self) -> bool:
        """True when chunk KV comes from the store (the connector is involved)."""
        return self.kind in ("naive", "legolink", "cacheblend", "query", "auto")

    @property
    def keeps_sink(self) -> bool:
        """True when each linked chunk's sink token (and its KV) stays in the prompt."""
        return self.links_chunks and self.form != "sink"


def _legolink(m: re.Match) -> Policy:
    k = int(m[2])
    form = m[1] or ("sink" if k == 0 else DEFAULT_LEGOLINK_FORM)  # legolink-0 is EPIC's LegoLink-0
    return Policy(m[0], "legolink", k=k, form=form)  # type: ignore[arg-type]


_PATTERNS = [
    (re.compile(r"^(full|prefix|naive)$"), lambda m: Policy(m[1], m[1])),
    (re.compile(r"^auto$"), lambda m: Policy("auto", "auto", form="sink")),
    (re.compile(r"^legolink-(?:(epic|sink)-)?(\d+)$"), _legolink),
    (
        re.compile(r"^cacheblend-(\d{1,2}(?:\.\d+)?|100)$"),
        lambda m: Policy(m[0], "cacheblend", ratio=float(m[1]) / 100.0),
    ),
    (
        re.compile(r"^query-(\d{1,2}(?:\.\d+)?|100)$"),
        lambda m: Policy(m[0], "query", ratio=float(m[1]) / 100.0, form="sink"),
    ),
]

POLICY_HELP = (
    "auto, full, prefix, naive, legolink-<k>, legolink-epic-<k>, legolink-sink-<k> (any k >= 0; k beyond a "
    "chunk's length recomputes all of it), cacheblend-<r>, query-<r> (r in 0..100 percent)"
)


def parse_policy(name: str) -> Policy:
    """Parse a policy name; raises ValueError with the accepted forms on anything else."""
    if not isinstance(name, str):
        raise ValueError(f"policy must be a string, got {type(name).__name__}")
    s = name.strip().lower()
    for pat, make in _PATTERNS:
        m = pat.match(s)
        if m:
            return make(m)
    raise ValueError(f"unknown policy {name!r}; expected one of: {POLICY_HELP}")
