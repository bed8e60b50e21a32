"""The link pass and its kernels: the batched recompute over linked pages (linker.py), cached KV into the
pages (stage.py, kernels.py), the paged-cache accessors per backend (layout.py), key re-rotation (rope.py), the
link's share of each step (budget.py) and of device memory (memory.py). Torch only: vLLM is reached through
engine/vllm_api.py."""
