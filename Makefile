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

# The README's main command: sets up what is missing, then runs the main job on the embedded default.
demo: setup
	$(VENV)/epic-rag ask --question "What does the json module's dumps function do?" --docs builtin:pydoc

bench: setup
	$(VENV)/python bench/bench_link.py
