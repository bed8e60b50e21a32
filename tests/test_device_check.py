"""scripts/device_check.py (issue 15): its logic end to end on CPU, in a process where vLLM cannot be
imported, as on the device machine it is written for (torch only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
