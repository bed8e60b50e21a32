"""What a GPU would pay per link layer, counted on a CPU: every ATen/custom op a piece of code dispatches, the
ones that would launch a kernel on a GPU, and the host synchronisations (a device value read on the host).

vLLM's IR ops (`vllm_ir.*`: RMS norms) dispatch as one torch op when vLLM wraps them (its compile mode on
CUDA) and run their chosen implementation below it, where a TorchDispatchMode no longer sees the ops; the
counter runs that implementation under itself, so a native norm counts its ~11 ops and a C kernel its one.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts dispatched ops, and host synchronisations: ops that read a device value on the host, plus
    tolist()/cpu()/numpy() calls (they do not dispatch on CPU tensors: tests spy on them and append to
    `syncs`); kernel launches that dispatch no torch op (Triton, stubbed kernels) are appended by name."""

    SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item")
    # metadata only on a GPU: no kernel launch (empty allocates from the caching allocator; a same-dtype .to
    # and contiguous() of a contiguous tensor return it)
    NO_LAUNCH = ("view", "reshape", "transpose", "split", "select", "slice", "as_strided", "permute", "expand")
    NO_LAUNCH += ("unsqueeze", "squeeze", "alias", "detach", "lift_fresh", "empty", "to.dtype", "contiguous", "t.")
    NO_LAUNCH += ("chunk", "flatten", "unflatten", "narrow", "unbind")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.syncs: list[str] = []
        self.paused = False

    def launches(self) -> list[str]:
        """The counted ops that would launch a kernel on a GPU."""
        return [op for op in self.ops if not any(f"aten.{n}" in op for n in self.NO_LAUNCH)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name.startswith("vllm_ir."):  # the implementation the op chose, counted op by op
            return self._ir_op(name, args, kwargs)
        if not self.paused:
            self.ops.append(name)
            if any(s in name for s in self.SYNC_OPS):
                self.syncs.append(name)
        return func(*args, **kwargs)

    def _ir_op(self, name: str, args, kwargs):
        from vllm.ir.op import IrOp

        op_name, _, overload = name[len("vllm_ir.") :].partition(".")
        op = IrOp.registry[op_name]
        call = op.maybe_inplace._inner_call if overload == "maybe_inplace" else op._inner_call
        with self:
            return call(*args, **kwargs)
