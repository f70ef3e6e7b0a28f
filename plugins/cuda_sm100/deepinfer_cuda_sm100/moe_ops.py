"""The MoE op of the ``cuda_sm100`` backend: ``moe_experts`` on Triton grouped GEMMs.

:func:`moe_ops` returns its :class:`OpImpl` (kernels in :mod:`deepinfer_cuda_sm100.kernels.moe`;
on FP4 experts the TileLang GEMMs of :mod:`deepinfer_cuda_sm100.tl.moe` or the decode-width GEMVs
of :mod:`deepinfer_cuda_sm100.kernels.moe_gemv` where the measured table picks them,
:mod:`deepinfer_cuda_sm100.moe_dispatch`)
with a ``supports`` predicate (shapes, dtypes and devices only) and conformance cases at the
shapes the kernels target: :data:`V4_FLASH_LIKE` on the GPU (V4-Flash's routing, top-6 of many
experts, at narrower widths so that the cases are quick to build), :data:`SMALL` under Triton's
CPU interpreter.  The cases cover FP4 experts with float32 and ue8m0 scales, plain experts in
the activation dtype and a mix of the two; a single decode token, blocks of tokens, more
tokens than ``E * k`` with expert 0 in every token (several tiles of one expert), a token
routed twice to one expert, a strided ``x`` and a clamp that bites.

Importing this module does not import Triton; :func:`moe_ops` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer_core.ops import OpImpl
from deepinfer_core.weights.quant import QuantizedTensor
from deepinfer_cuda_sm100.checks import device_problem, is_int_tensor

Verdict = bool | str
Cases = list[tuple[tuple, dict]]

MOE_OPS = ("moe_experts",)
"""The ops :func:`moe_ops` provides."""

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Activation dtypes the kernels take (plain expert stacks must have ``x``'s dtype)."""

MAX_TOP_K = 16
"""Most experts per token (the combine kernel keeps a token's slots in one register tile)."""
MAX_EXPERTS = 4096
"""Most experts per stack (the layout kernel keeps a histogram of them in registers)."""
_INT32_MAX = 2**31 - 1
_MAX_PADDING_ROWS = 64  # the tallest tile (kernels.moe.MAX_BLOCK_M): rows of padding per expert


@dataclass(frozen=True)
class MoeShapes:
    """Widths, expert count, top-k and token counts of one family of ``moe_experts`` cases."""

    hidden: int
    inter: int
    experts: int
    top_k: int
    tokens: tuple[int, ...]


V4_FLASH_LIKE = MoeShapes(hidden=512, inter=256, experts=32, top_k=6, tokens=(1, 16, 64))
"""GPU cases: V4-Flash's top-6 over many experts at narrow widths (the full widths, D=4096 and
I=2048 with up to 256 experts, run in ``tests/test_moe_kernel.py``: quantising them here on
the CPU, for every case the suite runs, would take minutes)."""
SMALL = MoeShapes(hidden=64, inter=32, experts=8, top_k=3, tokens=(1, 5, 19))
"""Interpreter cases: the same structure, narrow."""


# ---------------------------------------------------------------------------------------------
# supports


def _stack_tensors(name: str, w) -> list[tuple[str, object]]:
    if isinstance(w, QuantizedTensor):
        return [(f"{name}.data", w.data), (f"{name}.scale", w.scale)]
    return [(name, w)]


def _stack_problem(name: str, w, shape: tuple[int, int, int], x_dtype: torch.dtype) -> str | None:
    """Why the expert stack ``w`` (logical ``shape``) is not one the kernels read, or ``None``."""
    if tuple(w.shape) != shape:
        return f"{name} has shape {tuple(w.shape)}, expected {shape}"
    if isinstance(w, QuantizedTensor):
        group = w.block[1]
        if group < 2 or group & (group - 1):
            return f"{name} has FP4 scale groups of {group} inputs: the kernels need a power of two >= 2"
        if w.data.dim() != 3 or w.data.stride(-1) != 1 or w.scale.stride(-1) != 1:
            return f"{name}: FP4 data and scales must be [E, out, ...] with unit stride along the inputs"
        return None
    if w.dtype != x_dtype:
        return f"{name} dtype {w.dtype} differs from x's {x_dtype} (plain stacks run in x's dtype)"
    return None


def make_supports(interpreted: bool) -> Callable[..., Verdict]:
    """The ``moe_experts`` ``supports`` predicate, for ``interpreted`` (CPU) or compiled (CUDA) kernels.

    Looks at shapes, dtypes, strides and devices only (never at values: no device sync).
    """

    def moe_experts(x, ids, weights, gate_up, down, limit, shared=None) -> Verdict:
        for name, w in (("gate_up", gate_up), ("down", down)):
            if not isinstance(w, torch.Tensor | QuantizedTensor):
                return f"{name} is a {type(w).__name__}, not a tensor or QuantizedTensor"
            if isinstance(w, QuantizedTensor) and w.fmt != "fp4":
                return f"{name} is a {w.fmt} QuantizedTensor: the kernels read FP4 (e2m1) experts"
        named = [("x", x), ("ids", ids), ("weights", weights)]
        named += _stack_tensors("gate_up", gate_up) + _stack_tensors("down", down)
        problem = device_problem(interpreted, named)
        if problem:
            return problem
        if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
            return f"x must be [T, D] float32/bfloat16/float16, got {x.dim()}-D {x.dtype}"
        t, d = x.shape
        if ids.dim() != 2 or not is_int_tensor(ids) or ids.shape[0] != t:
            return f"ids must be a [T={t}, k] integer tensor, got {tuple(ids.shape)} {ids.dtype}"
        k = ids.shape[1]
        if not weights.is_floating_point() or tuple(weights.shape) != (t, k):
            return f"weights must be a float [{t}, {k}] tensor, got {tuple(weights.shape)} {weights.dtype}"
        if k > MAX_TOP_K:
            return f"top-k {k} exceeds {MAX_TOP_K} (a token's slots are combined in one register tile)"
        if len(gate_up.shape) != 3:
            return f"gate_up must be [E, 2I, D], got shape {tuple(gate_up.shape)}"
        e, two_i = gate_up.shape[0], gate_up.shape[1]
        if two_i % 2:
            return f"gate_up has {two_i} output rows: gate and up halves need an even count"
        inter = two_i // 2
        for name, w, shape in (("gate_up", gate_up, (e, two_i, d)), ("down", down, (e, d, inter))):
            problem = _stack_problem(name, w, shape, x.dtype)
            if problem:
                return problem
        if not 1 <= e <= MAX_EXPERTS:
            return f"{e} experts: 1..{MAX_EXPERTS} are supported (one register histogram)"
        if d == 0 or inter == 0:
            return f"empty widths (D={d}, I={inter})"
        if t * k + _MAX_PADDING_ROWS * e > _INT32_MAX:
            return f"{t * k} (token, slot) pairs: past the kernels' int32 pair indices"
        if isinstance(limit, bool) or not isinstance(limit, int | float) or math.isnan(limit):
            return f"limit must be a number, got {limit!r}"
        if shared is not None:
            if not isinstance(shared, torch.Tensor):
                return f"shared must be a [{t}, {d}] {x.dtype} tensor, got {type(shared).__name__}"
            if tuple(shared.shape) != (t, d) or shared.dtype != x.dtype:
                got = f"{tuple(shared.shape)} {shared.dtype}"
                return f"shared must be a [{t}, {d}] {x.dtype} tensor, got {got}"
            problem = device_problem(interpreted, [("shared", shared)])
            if problem:
                return problem
        return True

    return moe_experts


# ---------------------------------------------------------------------------------------------
# conformance cases


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _distinct_ids(g: torch.Generator, t: int, e: int, k: int) -> torch.Tensor:
    """``[t, k]`` int64: each token's ``k`` distinct experts in random order."""
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])


def moe_cases(s: MoeShapes) -> Callable[[torch.Generator, torch.dtype], Cases]:
    """``moe_experts`` cases of shapes ``s`` (see the module docstring)."""
    from deepinfer_core.ops._cases import randn_fp4

    def cases(g: torch.Generator, dtype: torch.dtype) -> Cases:
        d, i, e, k = s.hidden, s.inter, s.experts, s.top_k
        gu_scale, dn_scale = 1.5 * d**-0.5, i**-0.5  # gate / up of std 1.5; outputs of order 1

        def fp4(scale_dtype: str) -> tuple:
            return (
                randn_fp4(g, e, 2 * i, d, scale=gu_scale, scale_dtype=scale_dtype),
                randn_fp4(g, e, d, i, scale=dn_scale, scale_dtype=scale_dtype),
            )

        def plain() -> tuple:
            return (
                _randn(g, e, 2 * i, d, dtype=dtype, scale=gu_scale),
                _randn(g, e, d, i, dtype=dtype, scale=dn_scale),
            )

        def routing(t: int) -> torch.Tensor:
            w = _randn(g, t, k).abs() + 0.1
            return 1.5 * w / w.sum(-1, keepdim=True)  # renormalised, times a routed scale

        def tokens(t: int, ids: torch.Tensor) -> tuple:
            return _randn(g, t, d, dtype=dtype), ids, routing(t)

        out: Cases = []
        t_one, t_block, t_ragged = s.tokens
        out.append(((*tokens(t_one, _distinct_ids(g, t_one, e, k)), *fp4("fp32"), 10.0), {}))  # decode
        ids = _distinct_ids(g, t_block, e, k)
        ids[0, 1] = ids[0, 0]  # one token routed twice to an expert
        out.append(((*tokens(t_block, ids), *fp4("ue8m0"), 10.0), {}))
        out.append(((*tokens(t_ragged, _distinct_ids(g, t_ragged, e, k)), *plain(), 10.0), {}))
        # more tokens than E * k, expert 0 in every token: several tiles of one expert
        many = 3 * e * k + 1
        ids = _distinct_ids(g, many, e - 1, k) + 1
        ids[:, k // 2] = 0
        gate_up, _ = fp4("fp32")
        _, down = plain()
        out.append(((*tokens(many, ids), gate_up, down, 10.0), {}))  # FP4 gate_up, plain down
        # a strided x (a view of a wider activation) and a clamp that bites
        wide = _randn(g, t_block, d + 8, dtype=dtype)
        ids = _distinct_ids(g, t_block, e, k)
        out.append(((wide[:, 4 : 4 + d], ids, routing(t_block), *fp4("ue8m0"), 0.75), {}))
        return out

    return cases


def moe_ops() -> dict[str, OpImpl]:
    """``{op name: OpImpl}`` for :data:`MOE_OPS` (imports Triton and the kernels)."""
    from deepinfer_cuda_sm100.kernels import _common, moe
    from deepinfer_cuda_sm100.moe_dispatch import make_moe_experts

    interpreted = _common.INTERPRETED
    shapes = SMALL if interpreted else V4_FLASH_LIKE
    return {
        "moe_experts": OpImpl(
            fn=make_moe_experts(moe.moe_experts),  # TileLang / the GEMVs where measured faster
            supports=make_supports(interpreted),
            sample_cases=moe_cases(shapes),
        )
    }
