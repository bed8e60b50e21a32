"""Packaging: runtime extras hold no test-only packages, the framework extras force no vector store or embedding
model (nothing in the integrations imports one), the package is typed, and the CLI reports its version."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import epic_rag
from epic_rag.cli import main

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
TEST_ONLY = ("langchain-tests", "playwright", "openai")


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in reqs}


def test_test_only_packages_are_in_the_test_extra_only():
    extras = _extras()
    assert set(TEST_ONLY) <= _names(extras["test"])
    for name, reqs in extras.items():
        if name != "test":
            assert not set(TEST_ONLY) & _names(reqs), name


def test_framework_extras_force_no_vector_store_or_embeddings():
    extras = _extras()
    assert _names(extras["llamaindex"]) == {"llama-index-core"}
    assert _names(extras["langchain"]) == {"langchain-core"}


def test_importing_the_integrations_loads_no_vector_store_or_embedding_package():
    code = (
        "import sys, epic_rag.integrations.llamaindex, epic_rag.integrations.langchain\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('faiss', 'sentence_transformers', "
        "'langchain_community', 'langchain_huggingface') or m.startswith(('llama_index.vector_stores', "
        "'llama_index.embeddings.huggingface'))]\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_package_is_typed_and_ships_the_marker():
    assert (Path(epic_rag.__file__).parent / "py.typed").is_file()
    assert "py.typed" in (ROOT / "pyproject.toml").read_text()


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"epic-rag {epic_rag.__version__}"


def test_every_package_folder_is_installed_and_the_demo_installs_as_epic_rag_demo_not_apps():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "epic_rag").rglob("__init__.py")} | {
        "epic_rag_demo"
    }
    assert listed == found, listed ^ found
    assert tool["package-dir"] == {"epic_rag_demo": "apps/demo"}
    assert not any(name == "apps" or name.startswith("apps.") for name in listed)
    assert not (ROOT / "apps" / "__init__.py").exists()  # a top-level `apps` package would shadow other apps'
    r = subprocess.run(
        [sys.executable, "-c", "import epic_rag_demo, importlib.util as u; print(u.find_spec('apps'))"],
        cwd=ROOT.parent,  # outside the checkout: only what is installed can be imported
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stdout + r.stderr


def test_the_license_file_is_the_apache_2_text_pyproject_declares_and_the_citation_names_epic():
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a stub
    yaml = pytest.importorskip("yaml")
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    paper = cff["preferred-citation"]
    assert cff["cff-version"] == "1.2.0" and cff["license"] == "Apache-2.0"
    assert paper["title"].startswith("EPIC: Efficient Position-Independent Caching")
    assert paper["year"] == 2025 and paper["authors"][0] == {"family-names": "Hu", "given-names": "Junhao"}
    assert "2410.15332" in paper["url"]
