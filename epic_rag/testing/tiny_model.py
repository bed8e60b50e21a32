"""Build a tiny random Llama with a BPE tokenizer trained offline (~15 s): exactness tests only.

python -m epic_rag.testing.tiny_model OUT_DIR
"""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path


def build_tiny_model(out: str | Path, layers: int = 2, rope_scaling: dict | None = None, seed: int = 0) -> Path:
    """Write a 2-layer Llama (head_dim 32, 2 KV heads, GQA 2) and its tokenizer to `out`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    files = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "..", "*.py")))[:200]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    # A minimal chat template so RagRequest rendering is exercised on the tiny model too.
    hf_tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]\n{% endif %}"
    )
    hf_tok.save_pretrained(tmp)
    cfg = LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        tie_word_embeddings=False,
        rope_scaling=rope_scaling,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    # Random init at std 0.02 gives near-uniform attention; larger weights make attention peaky so that
    # position and context errors show up in the greedy tokens.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(4.0)
    model.save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another process built it first
        pass
    return out


if __name__ == "__main__":
    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
