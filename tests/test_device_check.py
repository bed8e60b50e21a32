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
    # scripts/device_link.py is the prepared GPU run of issues 24 and 33: its logic (every path, the pages
    # compared on zeroed caches, the attach check of the fused filler, its variants, the device budget, the
    # capture, the targets' verdicts) end to end at tiny shapes, the fused kernel under Triton's interpreter.
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
    assert summary["all_passed"] and summary["correctness"] == {"passed": True, "failed": []}
    assert summary["capture"]["equal"] and summary["budget"]["finished"]
    assert summary["attach_check"]["passed"] is True and summary["rows"]["fused, pinned host records"]["first_ms"]
    assert set(summary["fill_variants"]) == {"gptj_bf16", "partial_rotary_bf16", "neox_fp16"}
    assert all(v["passed"] for v in summary["fill_variants"].values())
    paths = {"fused, pinned host records", "fused, GPU-tier records", "torch filler, pinned host records"}
    assert paths <= set(summary["pages"])
    assert {"GEMMs only: fused, pinned host records", "reference: full prefill (op mix + causal SDPA)"} <= set(
        summary["rows"]
    )
    assert all(p["elements_beyond_1_ulp"] == 0 for p in summary["pages"].values())
    # targets printed beside their figures, judged on a GPU at full shapes only
    assert [(t["row"], t["target_ms"], t["verdict"]) for t in summary["targets"]] == [
        ("fused, pinned host records", 12.0, "NOT JUDGED"),
        ("fused, GPU-tier records", 8.0, "NOT JUDGED"),
    ]
    assert "CORRECTNESS: PASS" in proc.stdout and "TARGETS: NOT JUDGED" in proc.stdout
    assert "target <=  12.0 ms" in proc.stdout


def test_device_link_fails_its_correctness_verdict_when_a_path_writes_other_pages(tmp_path):
    # the verdict can fail: a torch filler that loses a layer's pages is caught by the attach check (it is the
    # reference there) and by the page comparison
    out = tmp_path / "link.json"
    script = (
        "import sys, runpy\n"
        "from epic_rag.engine.link import stage\n"
        "real = stage.TorchFiller.layer\n"
        "def lossy(self, f, li):\n"
        "    real(self, f, li)\n"
        "    self.caches[li].zero_() if li == 1 else None\n"
        "stage.TorchFiller.layer = lossy\n"
        f"sys.argv = ['device_link.py', '--device', 'cpu', '--tiny', '--out', {str(out)!r}]\n"
        f"runpy.run_path({str(SCRIPT.parent / 'device_link.py')!r}, run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=SCRIPT.parents[1],
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(SCRIPT.parents[1])},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    failed = summary["correctness"]["failed"]
    assert "attach_check" in failed and "fused, GPU-tier records" in failed, failed
    assert "CORRECTNESS: FAIL" in proc.stdout
