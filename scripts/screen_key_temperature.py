"""Dev-split screening of APE's attention temperature, emulated in the link (not shipped).

APE (ICLR 2025) divides the logits of query tokens over cached context by T; with S*T = 1 that is the same as
scaling the context's keys by 1/T, since q.(k/T) = (q.k)/T. This script runs the accuracy bench with the chunk
keys the linker writes from records scaled by 1/T after their rotation. Left alone, as APE leaves its shared
prefix alone: exact spans (the template prefix linked at position 0) and, for policies that keep it in the
prompt (naive), each chunk's own sink row. Recomputed tokens get fresh, unscaled keys; the question and
template are computed as usual. Results: docs/bench/qwen-query/dev.md.

    .venv/bin/python scripts/screen_key_temperature.py --t 0.9 -- --model qwen2.5-coder-0.5b-instruct \
        --split dev --samples niah=10 multidoc=20 docsqa=20 --tasks niah multidoc docsqa \
        --policies full naive query-15 --out docs/bench/qwen-query/dev/temp-0.9
"""

from __future__ import annotations

import argparse
import sys

import torch

from epic_rag.bench.cli import parse_args, run
from epic_rag.engine.link import stage
from epic_rag.engine.link.linker import Linker


def patch(t: float) -> None:
    """Scale linked chunk keys by 1/t in the CPU filler (TorchFiller), per fill row."""
    scales: dict[int, list[float]] = {}  # id(FillPlan) -> each fill row's key scale, in fill order
    plan_fill = Linker._plan_fill

    def plan_fill_and_scales(self, fill, s) -> None:
        if fill.num_rows == 0:  # a new plan (ids of freed plans are reused)
            scales[id(fill)] = []
        plan_fill(self, fill, s)
        rows, keeps_sink = scales[id(fill)], s.load.job.policy.keeps_sink
        for sp in s.load.job.spans:  # the rows the original added, in its order
            a, b = max(sp.start, s.load.start), min(sp.start + sp.kv.num_tokens, s.load.end)
            if a < b:
                r = [1.0 if sp.exact else 1.0 / t] * (b - a)
                if keeps_sink and not sp.exact and a == sp.start:
                    r[0] = 1.0  # the chunk's sink row (a sink-dropping policy links none)
                rows.extend(r)

    rotate, fill_layer, current = stage.rotate_rows_, stage.TorchFiller.layer, {}

    def layer(self, f, li: int) -> None:
        current["plan"] = id(f.plan)  # the plan whose rows the rotation below sees
        fill_layer(self, f, li)

    def rotate_and_scale_(k: torch.Tensor, cos, sin, rot: int, neox: bool) -> None:
        # k: [M, Hkv, D] the pass's staged record rows, rotated in place, then each row scaled in place
        rotate(k, cos, sin, rot, neox)
        scale = torch.tensor(scales[current["plan"]], dtype=k.dtype, device=k.device)  # [M]
        assert len(scale) == len(k)
        k.mul_(scale[:, None, None])

    Linker._plan_fill = plan_fill_and_scales
    stage.TorchFiller.layer = layer
    stage.rotate_rows_ = rotate_and_scale_


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--t", type=float, required=True, help="APE's temperature T: linked keys are scaled by 1/T")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then `epic-rag bench accuracy` arguments")
    a = p.parse_args()
    if not a.t > 0:
        p.error("--t must be positive")
    patch(a.t)
    bench = [x for x in a.bench if x != "--"]
    print(run(parse_args(["accuracy", *bench])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
