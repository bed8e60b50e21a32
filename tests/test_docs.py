"""The documentation site builds strictly (a broken link or anchor, or a reference to a name the code no longer
has, fails it), and its API reference lists every public name of `epic_rag` and `epic_rag.integrations.*` and
every connector option, so the docs cannot drift from the code's names."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _all(init: Path) -> set[str]:
    """A package's __all__, read without importing it."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}
    raise AssertionError(f"{init} has no __all__")


def _fields(path: Path, cls: str) -> set[str]:
    (node,) = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra (make setup installs it)")
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "WARNING" not in r.stderr, r.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def documented(site) -> set[str]:
    """Every object the API reference renders (mkdocstrings' inventory)."""
    header, _, body = (site / "objects.inv").read_bytes().partition(b"zlib.\n")
    return {line.split(" ")[0] for line in zlib.decompress(body).decode().splitlines()}


def test_the_site_builds_strictly_with_every_page_of_the_nav(site):
    for page in ("getting-started", "concepts", "python-api", "vllm-serve", "benchmarks", "gpu-status", "reliability"):
        assert (site / page / "index.html").is_file(), page


@pytest.mark.parametrize(
    "package",
    ["epic_rag", "epic_rag/integrations", "epic_rag/integrations/llamaindex", "epic_rag/integrations/langchain"],
)
def test_the_api_reference_lists_every_public_name(package, documented):
    names = {n for n in _all(ROOT / package / "__init__.py") if not n.startswith("__")}
    assert names
    short = {d.rsplit(".", 1)[-1] for d in documented}
    assert names <= short, sorted(names - short)


def test_every_connector_option_is_a_documented_field_and_every_option_read_is_one():
    config = ROOT / "epic_rag" / "engine" / "connector" / "config.py"
    fields = _fields(config, "ConnectorConfig")
    assert {"store", "local", "workspace_tokens", "async_links", "link_step_share", "find_chunks", "tenant"} <= fields
    read = set()
    for path in (ROOT / "epic_rag" / "engine").glob("*.py"):
        read |= set(re.findall(r"""extra(?:\.get\(|\[)["'](\w+)["']""", path.read_text()))
    assert read and read <= fields, sorted(read - fields)  # a new option is added to ConnectorConfig (and its docs)


def test_the_connector_options_appear_in_the_api_reference(documented):
    fields = _fields(ROOT / "epic_rag" / "engine" / "connector" / "config.py", "ConnectorConfig")
    cls = "epic_rag.engine.connector.config.ConnectorConfig"
    assert cls in documented and {f"{cls}.{f}" for f in fields} <= documented
