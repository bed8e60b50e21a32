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
from decimal import ROUND_HALF_UP, Decimal
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


# Every command and Python block of the README and the docs pages is run by a test or says why it is not:
# `<!-- run in the test: NAME -->` (the page's own test picks the block by NAME), `<!-- run by tests/X.py -->`
# (that test reads the page and runs or compares the block) or `<!-- not run: why -->`, on the line before it.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- ([^\n]*?) -->\n)?```(bash|python|sh|console)\n", re.S)


def _blocks(page: Path) -> list[tuple[int, str | None]]:
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 1, m[1]) for m in BLOCK.finditer(text)]


def _tests_mentioning(*needles: str) -> list[Path]:
    return [p for p in (ROOT / "tests").glob("test_*.py") if all(n in p.read_text() for n in needles)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_and_python_block_is_run_by_a_test_or_marked_not_run(page):
    blocks = _blocks(page)
    for line, mark in blocks:
        where = f"{page.name}:{line}"
        assert mark, f"{where}: a code block with no <!-- run in the test / run by / not run --> mark"
        if mark.startswith("run in the test: "):
            name = mark.removeprefix("run in the test: ")
            assert _tests_mentioning(page.name, f'"{name}"'), f"{where}: no test reads {page.name} and runs {name!r}"
        elif mark.startswith("run by "):
            test = ROOT / mark.removeprefix("run by ")
            assert test.is_file() and page.name in test.read_text(), f"{where}: {test} does not read {page.name}"
        else:
            assert mark.startswith("not run: ") and len(mark) > len("not run: ") + 10, f"{where}: mark {mark!r}"


def test_the_block_marks_are_read_as_meant():
    """The check above, on a made-up page: an unmarked block and a marked one are told apart."""
    page = "text\n\n```bash\nls\n```\n\n<!-- not run: an example of a mark -->\n```python\nprint(1)\n```\n"
    marks = [m[1] for m in BLOCK.finditer(page)]
    assert marks == [None, "not run: an example of a mark"]


# Every figure in the README's tables comes from the bench files that the paragraph right after the table
# links: each number of a row is, at the precision the README prints, a number on the line of a linked file's
# table that starts with the row's policy (the accuracy bench names LegoLink's sink form `legolink-sink-<k>`).
NUMBER = re.compile(r"(?<![\w.-])-?\d+(?:\.\d+)?(?![\w.])")


def _readme_tables() -> list[tuple[list[str], list[Path]]]:
    """(table rows, bench files linked by the paragraph after the table) for each README table."""
    out = []
    for m in re.finditer(r"((?:^\|.*\|\n)+)\n((?:.+\n)+)", (ROOT / "README.md").read_text(), re.M):
        rows = [r for r in m[1].splitlines()[2:]]
        links = [ROOT / p for p in re.findall(r"\]\((docs/bench/[^)#]+)\)", m[2])]
        out.append((rows, links))
    return out


def _matches(figure: str, line: str) -> bool:
    """`figure` is a number of `line` rounded (half up, in decimal) to the places the figure prints."""
    step = Decimal(1).scaleb(-len(figure.partition(".")[2]))
    return any(Decimal(n).quantize(step, ROUND_HALF_UP) == Decimal(figure) for n in NUMBER.findall(line))


def test_every_number_in_the_readmes_tables_is_in_the_bench_files_it_links():
    tables = _readme_tables()
    assert tables, "the README has no table of measured figures"
    for rows, links in tables:
        assert links and all(p.is_file() for p in links), links
        lines = [ln.replace("-sink-", "-") for p in links for ln in p.read_text().splitlines()]
        for row in rows:
            policy = re.search(r"`([\w./-]+)`", row)[1]  # nbr2/legolink-16: a refined policy
            source = [ln for ln in lines if ln.startswith(f"| {policy} |")]
            for figure in NUMBER.findall(row.split("|", 2)[2]):
                assert any(_matches(figure, ln) for ln in source), f"README: {policy}'s {figure} is not in {links}"


def test_the_figure_check_catches_a_figure_the_bench_files_do_not_hold():
    line = "| full | 13.308 | 12.853 | 1.000 |"
    assert _matches("13.3", line) and _matches("1", line) and not _matches("13.4", line)
    assert _matches("4.76", "| full | 4.755 |")  # half up, as printed (binary floats round 4.755 down)


def test_the_readme_shows_the_install_within_25_lines_python_within_45_and_stays_within_120():
    lines = (ROOT / "README.md").read_text().splitlines()
    first = lambda pred: next(i for i, line in enumerate(lines, 1) if pred(line))  # noqa: E731
    assert first(lambda line: line.startswith("pip install ")) <= 25
    assert first(lambda line: line.startswith("from epic_rag import")) <= 45
    assert len(lines) <= 120, len(lines)
