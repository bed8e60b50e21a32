"""Link policies, parsed from strings such as "legolink-16" or "cacheblend-15"."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Kind = Literal["full", "prefix", "naive", "legolink", "cacheblend"]

# LegoLink compiles every chunk behind this many dummy (BOS) tokens and drops their KV: the chunk's own
# tokens are then computed against a real attention sink, as after the prompt's first token in a full
# prefill, instead of making the chunk's first word the sink. EPIC's reference keeps each chunk's BOS
# for the same reason (and its LegoLink-0 prepends 3 BOS). Naive and CacheBlend link chunks compiled
# bare, from position 0, as those baselines do.
DUMMY_PREFIX_LEN = 3


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    kind: Kind
    k: int = 0            # legolink: tokens recomputed at the head of each chunk
    ratio: float = 0.0    # cacheblend: fraction of chunk tokens recomputed after the check layer

    @property
    def links_chunks(self) -> bool:
        """True when chunk KV comes from the store (the connector is involved)."""
        return self.kind in ("naive", "legolink", "cacheblend")

    @property
    def compile_variant(self) -> str:
        """Which compiled form of a chunk this policy links (part of the chunk key). Every legolink-k
        links the same one, so a corpus compiled once serves any k."""
        if self.kind == "legolink":
            return f"dummy{DUMMY_PREFIX_LEN}"
        return "plain"


_PATTERNS = [
    (re.compile(r"^(full|prefix|naive)$"), lambda m: Policy(m[1], m[1])),
    (re.compile(r"^legolink-(\d{1,4})$"), lambda m: Policy(m[0], "legolink", k=int(m[1]))),
    (re.compile(r"^cacheblend-(\d{1,2}(?:\.\d+)?|100)$"),
     lambda m: Policy(m[0], "cacheblend", ratio=float(m[1]) / 100.0)),
]

POLICY_HELP = "full, prefix, naive, legolink-<k> (k >= 0), cacheblend-<r> (r in 0..100 percent)"


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
