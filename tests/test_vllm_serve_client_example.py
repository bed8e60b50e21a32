"""examples/vllm_serve_client.py, run as a user runs it against stock `vllm serve` with EpicConnector (the
session's one-layer tiny-model server, the finder on with legolink-0): its chunks compile, its named link and
the server's find both link every chunk, and on this model a link that recomputes nothing answers token for
token like the plain prompt (a linked chunk's KV is exact on one layer)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid

import pytest
from _engine_process import ROOT

pytestmark = pytest.mark.slow  # the session's vllm serve process


def test_the_vllm_serve_client_example_compiles_links_and_finds_its_chunks_like_the_plain_prompt(tiny_serve):
    url, tok, log = tiny_serve
    cmd = [sys.executable, "examples/vllm_serve_client.py", "--url", url, "--model", "tiny"]
    cmd += ["--tokenizer", tok.name_or_path, "--policy", "legolink-0", "--tenant", f"example-{uuid.uuid4().hex}"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:] + log.read_text()[-3000:]
    out = p.stdout
    assert re.search(r"^compiled: \S+, \S+, \S+$", out, re.M), out
    linked = json.loads(re.search(r"^linked params: (.*)$", out, re.M)[1])
    assert linked["linked_spans"] == 3 and linked["missing"] == [], linked
    found = json.loads(re.search(r"^found params: (.*)$", out, re.M)[1])
    assert found.get("linked_spans") == 3 or found.get("prefix_hit", 0) > 0, found
    answers = dict(re.findall(r"^(linked|found|plain)(?: \([^)]*\))?: (.*)$", out, re.M))
    assert answers["linked"] == answers["plain"] == answers["found"], answers
