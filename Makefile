.PHONY: setup test demo bench
VENV := .venv/bin
PYTEST := $(VENV)/python -m pytest -q -ra

setup:
	@bash scripts/setup.sh

# The README's test command: sets up what is missing, then runs every test on CPU.
# vLLM keeps one KV connector per process, so tiny-model, SmolLM2 and Qwen tests run as three pytest sessions.
test: setup
	$(VENV)/ruff check epic_rag apps tests scripts
	$(VENV)/ruff format --check epic_rag apps tests scripts
	$(PYTEST) -m "not smollm and not qwen" tests
	$(PYTEST) -m smollm tests
	$(PYTEST) -m qwen tests

# The README's main command: sets up what is missing, then runs the main job on the embedded default:
# the demo chat app (Qwen2.5-Coder-0.5B-Instruct, pydoc corpus, FAISS, disk chunk store) on http://127.0.0.1:8000.
demo: setup
	$(VENV)/epic-rag demo

# Benchmarks (not tests): every part (link, store, accuracy, sync, load, scaling) writes <part>.json and
# Markdown into docs/bench/ with the command that made it.
bench: setup
	$(VENV)/epic-rag bench all --out docs/bench
