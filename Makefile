.PHONY: setup test test-fast lint docs demo bench
VENV := .venv/bin
PYTEST := $(VENV)/python -m pytest -q -ra
LINTED := epic_rag apps tests scripts examples

setup:
	@bash scripts/setup.sh

lint: setup
	$(VENV)/ruff check $(LINTED)
	$(VENV)/ruff format --check $(LINTED)

# The README's test command: sets up what is missing, lints, then runs every test on CPU (tests/test_docs.py
# builds the docs strictly: a broken link or a name the code no longer has fails it). vLLM keeps one KV connector
# per process, so tiny-model, SmolLM2 and Qwen tests run as three pytest sessions.
test: setup lint
	$(PYTEST) -m "not smollm and not qwen" tests
	$(PYTEST) -m smollm tests
	$(PYTEST) -m qwen tests

# The edit loop: sets up what is missing, lints, then the tiny-model tests that start no engine, server or model
# process of their own (no `slow`, `smollm` or `qwen` mark); `make test` (and CI) still run everything.
test-fast: lint
	$(PYTEST) -m "not slow and not smollm and not qwen" tests

# The documentation site (MkDocs Material; API reference from the docstrings) into build/site.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/mkdocs build --strict --site-dir build/site

# The README's main command: sets up what is missing, then runs the main job on the embedded default:
# the demo chat app (Qwen2.5-Coder-0.5B-Instruct, pydoc corpus, FAISS, disk chunk store) on http://127.0.0.1:8000.
demo: setup
	$(VENV)/epic-rag demo

# Benchmarks (not tests): every part (link, store, accuracy, sync, load, scaling) writes <part>.json and
# Markdown into docs/bench/ with the command that made it.
bench: setup
	$(VENV)/epic-rag bench all --out docs/bench
