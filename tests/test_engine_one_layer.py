"""Rotation and placement of linked KV, checked exactly: in a one-layer model every cached K/V is a function of
its own token and position only (no context), so linking without any recompute must equal `full` over the same
tokens token for token, whatever the chunk order. Any error in the key rotation, the base position of a record
with or without its sink, or where spans land in the pages shows up here. (`legolink-9999 == full` cannot see
such errors: it overwrites every cached entry.) The engine runs in a subprocess: one vLLM engine per process."""

from __future__ import annotations

import _engine_process
import pytest

pytestmark = pytest.mark.slow  # starts an engine in its own process


SCRIPT = r"""
import dataclasses, json
from epic_rag import EngineConfig, EpicEngine, RagRequest, parse_policy
from epic_rag.paths import cache_dir
from epic_rag.testing.tiny_model import build_tiny_model

model = build_tiny_model(cache_dir() / "test-models" / "tiny-llama-1layer", layers=1)
eng = EpicEngine(EngineConfig(model=str(model), store="memory", max_model_len=2048, max_num_seqs=4, kv_cache_gib=1,
                              dtype="float32"))
chunks = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n",
          "class Stack:\n    def push(self, x):\n        self.items.append(x)\n"]
out = {}
for order in (chunks, chunks[::-1], [chunks[1], chunks[2], chunks[0]]):
    req = RagRequest(question="which function adds?", chunks=order)
    for pol in ("naive", "legolink-0", "legolink-epic-3", "legolink-sink-3"):   # (cacheblend: needs 2+ layers)
        prep = eng.prepare(req, max_tokens=24, policy=pol)
        linked = eng.generate(prep)
        full = eng.generate(dataclasses.replace(prep, policy=parse_policy("full")))
        out.setdefault(pol, []).append([linked.token_ids == full.token_ids, linked.linked_tokens])
print("RESULT " + json.dumps(out), flush=True)
eng.shutdown()
"""


def test_one_layer_model_links_exactly_in_any_order_under_every_policy():
    for policy, runs in _engine_process.run(SCRIPT, {}).items():
        for same, linked in runs:
            assert linked > 0 and same, (policy, runs)
