.PHONY: setup test demo bench
VENV := .venv/bin
PYTEST := $(VENV)/python -m pytest -q -ra

setup:
	@bash scripts/setup.sh

# The README's test command: sets up what is missing, then runs every test on CPU.
# vLLM keeps one KV connector per process, so tiny-model and SmolLM2 tests run as two pytest sessions.
test: setup
	$(PYTEST) -m "not smollm" tests
	$(PYTEST) -m smollm tests

# The README's main command: sets up what is missing, then runs the main job on the embedded default:
# the demo chat app (SmolLM2, pydoc corpus, FAISS, disk chunk store) on http://127.0.0.1:8000.
demo: setup
	$(VENV)/epic-rag demo

# Benchmarks (not tests): every part (link, store, accuracy, sync, async, scaling) writes <part>.json and
# Markdown into docs/bench/ with the command that made it.
bench: setup
	$(VENV)/epic-rag bench all --out docs/bench
