"""docs/getting-started.md, run: the commands after each "run in the test" mark, as a newcomer runs them from the
checkout's root (its own port and data folder substituted, so it runs beside anything else), and what the page
says they give: the demo comes up, compiles its corpus and answers the page's question with json.dumps and
indent from linked chunks; the Python snippet answers from its linked chunks.

`make setup` and `make test` are the page's other commands: CI runs them itself (.ci/run)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess

import pytest
from _engine_process import ROOT

pytestmark = [pytest.mark.qwen, pytest.mark.slow]  # the demo's model, in processes of their own
PAGE = ROOT / "docs" / "getting-started.md"


def page_commands() -> dict[str, str]:
    """name -> the bash block that follows `<!-- run in the test: name -->` on the page."""
    text = PAGE.read_text()
    blocks = re.findall(r"<!-- run in the test: (\w+) -->\n```bash\n(.*?)```", text, re.S)
    return dict(blocks)


def _bash(script: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-ec", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


@pytest.fixture(scope="module")
def demo(env, tmp_path_factory):
    """The page's demo block, run: its last command returns once every chunk is compiled."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = tmp_path_factory.mktemp("demo-data")
    script = page_commands()["demo"].replace("epic-rag demo", f"epic-rag demo --port {port} --data-dir {data}")
    script = script.replace("localhost:8000", f"localhost:{port}")
    log = open(data / "demo.log", "w")
    # a session of its own: the demo it starts in the background is killed with it
    p = subprocess.Popen(["bash", "-ec", script], cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        assert p.wait(timeout=900) == 0, (data / "demo.log").read_text()[-4000:]
        yield port
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        log.close()


def test_the_page_names_the_commands_this_test_runs():
    assert set(page_commands()) == {"demo", "ask", "python"}
    assert "make demo" in PAGE.read_text() and "make test" in PAGE.read_text()


def test_the_demo_answers_the_pages_question_from_linked_chunks(demo, env):
    r = _bash(page_commands()["ask"].replace("localhost:8000", f"localhost:{demo}"), env, timeout=300)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    answer = body["choices"][0]["message"]["content"]
    assert "json.dumps" in answer and "indent" in answer, answer
    epic = body["epic"]
    # the default, auto: legolink-16 once the retrieved chunks are refined behind their neighbours, query-20 before
    assert epic["policy"] in ("legolink-16", "query-20") and epic["policy_asked"] == "auto", epic
    assert epic["chunk_misses"] == 0 and epic["chunk_hits"] > 0, epic
    assert epic["linked_tokens"] > epic["recomputed_tokens"] > 0, epic
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == epic["linked_tokens"]
    assert any(s["doc"] == "pydoc-json.txt" for s in epic["sources"]), epic["sources"]


def test_the_python_snippet_is_the_readmes_example():
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"## Quick start\n\n(?:<!--.*?-->\n)?```python\n(.*?)```", readme, re.S)[1]
    assert example in page_commands()["python"]


def test_the_python_snippet_answers_from_its_linked_chunks(env):
    r = _bash(page_commands()["python"], env, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    figures = re.search(r"^TTFT [\d.]+ s, (\d+) of (\d+) prompt tokens linked$", r.stdout, re.M)
    assert figures and "412" in r.stdout[: figures.start()], r.stdout  # the linked answer
    linked, prompt = map(int, figures.groups())
    assert 0 < linked < prompt, figures[0]
    assert "412" in r.stdout[figures.end() :], r.stdout  # the streamed answer under `full`
