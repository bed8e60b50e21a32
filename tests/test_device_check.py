"""scripts/device_check.py (issue 15): its logic end to end on CPU, in a process where vLLM cannot be
imported, as on the device machine it is written for (torch only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts the device scripts in their own processes, under the Triton interpreter

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_check.py"


def test_device_check_passes_on_cpu_without_vllm(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--dtype", "fp32", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert summary["all_passed"] and not summary["env"]["vllm_importable"]
    names = [c["name"] for c in summary["checks"]]
    failed = [c for c in summary["checks"] if not c["passed"]]
    assert not failed, failed
    for part in ("rotation/", "layout/", "attention/buffer_path", "attention/runs_plan_sdpa", "attention/flash_layout"):
        assert any(n.startswith(part) for n in names), (part, names)
    assert len(summary["timings_ms"]) == 5


def test_device_link_runs_the_real_linker_on_cpu_under_the_triton_interpreter(tmp_path):
    # scripts/device_link.py is the prepared GPU run of issue 24: its logic (every path, the pages compared, the
    # device budget, the capture) end to end at tiny shapes, the fused kernel under Triton's interpreter.
    out = tmp_path / "link.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "device_link.py"), "--device", "cpu", "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert summary["all_passed"] and summary["capture"]["equal"]
    assert {"fused, pinned host records", "fused, GPU-tier records", "torch filler, pinned host records"} <= set(
        summary["pages"]
    )
    assert all(p["elements_beyond_1_ulp"] == 0 for p in summary["pages"].values())
