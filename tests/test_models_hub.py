"""Model names as vLLM users type them: a Hugging Face id resolves through huggingface_hub's own cache. No hub is
reachable here, so each test builds a local hub cache (the layout huggingface_hub writes: refs/main naming a
snapshot folder) from the tiny test model and points HF_HUB_CACHE at it with HF_HUB_OFFLINE set. The resolution
runs in a fresh process: huggingface_hub reads those variables when it is imported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from epic_rag.models import _is_hub_id, resolve_model

ROOT = Path(__file__).resolve().parents[1]
REPO = "test-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, tiny_model_dir) -> Path:
    """A hub cache holding REPO at COMMIT: the tiny model's files in its snapshot folder."""
    repo = tmp_path / "hub" / ("models--" + REPO.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(tiny_model_dir, repo / "snapshots" / COMMIT)
    return tmp_path / "hub"


def _resolve_offline(name: str, hub: Path, cache: Path) -> dict:
    """resolve_model(name) and the folder's fingerprint in a fresh process, offline, on the hub cache `hub`."""
    script = (
        "import json, sys\n"
        "from types import SimpleNamespace as NS\n"
        "from epic_rag.models import model_fingerprint, resolve_model\n"
        "try:\n"
        "    p = resolve_model(sys.argv[1])\n"
        "except ValueError as e:\n"
        "    print(json.dumps({'error': str(e)}))\n"
        "    sys.exit(0)\n"
        "import torch\n"
        "from epic_rag.engine.vllm_api import worker_fingerprint\n"
        "cfg = NS(model_config=NS(model=sys.argv[1], tokenizer=sys.argv[1]))  # as `vllm serve ID` keeps it\n"
        "kv = worker_fingerprint(cfg, torch.float32)\n"
        "print(json.dumps({'path': str(p), 'fp': model_fingerprint(p), 'kv': kv}))\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1",
        "EPIC_RAG_CACHE": str(cache),
        "HOME": str(cache),
    }
    p = subprocess.run(
        [sys.executable, "-c", script, name], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_hugging_face_id_resolves_offline_to_its_snapshot_and_the_same_model_fingerprint(
    hub_cache, tiny_model_dir, tmp_path
):
    from epic_rag.models import model_fingerprint

    got = _resolve_offline(REPO, hub_cache, tmp_path / "cache")
    snapshot = hub_cache / ("models--" + REPO.replace("/", "--")) / "snapshots" / COMMIT
    assert Path(got["path"]) == snapshot
    assert got["fp"] == model_fingerprint(tiny_model_dir)  # the same config and weight bytes


def test_a_vllm_serve_worker_started_on_a_hugging_face_id_keys_chunks_as_for_its_local_folder(
    hub_cache, tiny_model_dir, tmp_path
):
    """`vllm serve ID` keeps the id as its model; the connector's fingerprint (part of every chunk key) must
    still be the one an engine on the downloaded folder computes, or their chunks would never meet."""
    from types import SimpleNamespace as NS

    import torch

    from epic_rag.engine.vllm_api import worker_fingerprint

    got = _resolve_offline(REPO, hub_cache, tmp_path / "cache")
    local = NS(model_config=NS(model=str(tiny_model_dir), tokenizer=str(tiny_model_dir)))
    assert got["kv"] == worker_fingerprint(local, torch.float32)


def test_a_hugging_face_id_missing_from_the_offline_cache_is_refused_with_what_to_do(hub_cache, tmp_path):
    got = _resolve_offline("test-org/not-downloaded", hub_cache, tmp_path / "cache")
    assert "HF_HUB_OFFLINE is set" in got["error"] and "hf download test-org/not-downloaded" in got["error"]


def test_a_cached_snapshot_without_weights_is_refused(hub_cache, tmp_path):
    snapshot = hub_cache / ("models--" + REPO.replace("/", "--")) / "snapshots" / COMMIT
    for w in snapshot.glob("*.safetensors"):
        w.unlink()
    got = _resolve_offline(REPO, hub_cache, tmp_path / "cache")
    assert "holds no weights" in got["error"]


@pytest.mark.parametrize(
    "name,is_id",
    [
        ("Qwen/Qwen2.5-7B-Instruct", True),
        ("meta-llama/Llama-3.1-8B-Instruct", True),
        ("./models/qwen", False),  # explicit relative path
        ("/srv/models/qwen", False),
        ("~/models/qwen", False),
        ("models/qwen/v2", False),  # two slashes: a path
        ("qwen2.5-coder-0.5b-instruct", False),  # a packaged name
        ("org/bad--name", False),  # huggingface_hub rejects '--'
    ],
)
def test_names_with_one_slash_are_hub_ids_and_paths_are_not(name, is_id):
    assert _is_hub_id(name) is is_id


def test_a_local_folder_without_config_json_is_refused_as_not_a_model(tmp_path):
    with pytest.raises(ValueError, match="holds no config.json"):
        resolve_model(str(tmp_path))


def test_an_unknown_name_is_refused_naming_the_three_accepted_forms():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*local folder.*Hugging Face model id"):
        resolve_model("no-such-model")
