"""Engine scripts run in their own processes (vLLM allows one engine per process): the command, the
environment, and the JSON each prints on a line starting "RESULT "."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def command(script: str, cfg: dict) -> list[str]:
    return [sys.executable, "-c", script, json.dumps(cfg)]


def environment(**extra: str) -> dict[str, str]:
    """This checkout's code, a 1 GiB CPU KV cache, and `extra`."""
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT), **extra)


def result(returncode: int, stdout: str, stderr: str) -> dict:
    """The last RESULT line's JSON; fails the test, with the end of stderr, when the script failed."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert returncode == 0 and lines, f"engine process failed (rc={returncode}):\n{stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def run(script: str, cfg: dict, timeout: int = 900, **env: str) -> dict:
    p = subprocess.run(
        command(script, cfg), capture_output=True, text=True, cwd=ROOT, env=environment(**env), timeout=timeout
    )
    return result(p.returncode, p.stdout, p.stderr)
