"""The shared expert of a DeepSeek-V4 / V4.1 MoE block, beside its router and routed experts.

The shared expert (``down(swiglu(gate(x), up(x)))``) reads only the block input, and the routed
experts only the router's choice: two chains that meet in the block's sum.  :func:`shared_expert`
runs the router's projection on the current stream and the shared expert on a side branch
(:func:`~deepinfer_core.ops.overlap.fork`: a second CUDA stream at decode sizes, inline
elsewhere), so that at decode the routing and the routed experts' kernels run while the shared
expert's do.
"""

from __future__ import annotations

import torch

from deepinfer_core.ops import OpTable
from deepinfer_core.ops.overlap import Branch, fork
from deepinfer_core.weights.quant import Weight

from .fused import FusedProjection

ROUTER = range(1)
"""The router's part of the block's input projection (then the shared expert's gate and up)."""
GATE_UP = range(1, 3)


def shared_expert(
    x: torch.Tensor, w_in: FusedProjection, s_down: Weight, ops: OpTable, limit: float, overlap: bool = True
) -> tuple[torch.Tensor, Branch[torch.Tensor]]:
    """``(router logits, branch)`` of the block input ``x`` ``[T, D]`` (``w_in``: the router's,
    then the shared gate's and up's projections; ``s_down``: the shared down projection;
    ``limit``: the SwiGLU clamp): ``branch.join()`` gives the shared expert's output
    (``overlap=False``: computed inline, at once).  Where the router's matmul is not the shared
    expert's (a quantised checkpoint's BF16 router beside its FP8 shared expert) the branch also
    computes the shared gate / up projection; the bits are those of
    :meth:`FusedProjection.__call__` either way."""
    if w_in.separable(ROUTER):
        (logits,) = w_in.project(x, ops, ROUTER)

        def chain() -> torch.Tensor:
            s_gate, s_up = w_in.project(x, ops, GATE_UP)
            return ops.linear(ops.swiglu(s_gate, s_up, limit), s_down)

        return logits, fork(x, chain, enabled=overlap)
    logits, s_gate, s_up = w_in(x, ops)
    return logits, fork(
        x, lambda: ops.linear(ops.swiglu(s_gate, s_up, limit), s_down), s_gate, s_up, enabled=overlap
    )
