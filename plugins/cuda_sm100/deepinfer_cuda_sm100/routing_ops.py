"""The routing op of the ``cuda_sm100`` backend: ``moe_route`` in one Triton kernel.

:func:`routing_ops` returns its :class:`OpImpl` (kernel in
:mod:`deepinfer_cuda_sm100.kernels.routing`) with a ``supports`` predicate (shapes, dtypes and
devices only) and conformance cases at the shapes the kernel targets: :data:`V4_FLASH_LIKE` on
the GPU (V4-Flash's router: 256 experts, top-6; a single decode token, a block of tokens and
200 tokens), :data:`SMALL` under Triton's CPU interpreter (the same experts, fewer tokens).  The
cases cover each scoring function (``sqrtsoftplus``, ``sigmoid``, ``softmax``) with and
without the ``noaux_tc`` correction bias, logits that are a strided view of a wider
projection, hash routing (``fixed_ids`` of int64 and int32, a token routed twice to one
expert) and exact ties (few distinct logits; equal scores with tied biases), which the
kernel must break toward the lower expert id as the reference's stable sort does.

Importing this module does not import Triton; :func:`routing_ops` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer_core.ops import OpImpl
from deepinfer_cuda_sm100.checks import device_problem, is_int_tensor

Verdict = bool | str
Cases = list[tuple[tuple, dict]]

ROUTING_OPS = ("moe_route",)
"""The ops :func:`routing_ops` provides."""

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Logit dtypes the kernel takes (the weights come back in the same dtype)."""

SCORINGS = ("sqrtsoftplus", "sigmoid", "softmax")
"""The scoring functions of the contract, all of which the kernel computes."""

MAX_EXPERTS = 1024
"""Most experts (a token's scores are one register row; PyTorch's warp softmax, whose order
the kernel follows, takes rows of at most 1024)."""
MAX_TOP_K = 16
"""Most experts per token (the selection rounds are unrolled; ``moe_experts`` takes 16 too)."""


@dataclass(frozen=True)
class RouteShapes:
    """Expert count, top-k and token counts of one family of ``moe_route`` cases."""

    experts: int
    top_k: int
    tokens: tuple[int, int, int]
    """A single decode token, a block of tokens, a larger (ragged) count."""


V4_FLASH_LIKE = RouteShapes(experts=256, top_k=6, tokens=(1, 16, 200))
"""GPU cases: V4-Flash's router (256 experts, top-6)."""
SMALL = RouteShapes(experts=256, top_k=6, tokens=(1, 16, 37))
"""Interpreter cases: the same router, fewer tokens (the interpreter runs a program in ~10 ms)."""


# ---------------------------------------------------------------------------------------------
# supports


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def make_supports(interpreted: bool) -> Callable[..., Verdict]:
    """The ``moe_route`` ``supports`` predicate, for ``interpreted`` (CPU) or compiled (CUDA) kernels.

    Looks at shapes, dtypes, strides and devices only (never at values: no device sync).
    """

    def moe_route(logits, correction_bias, fixed_ids, top_k, scoring, routed_scale) -> Verdict:
        if scoring not in SCORINGS:
            return f"scoring {scoring!r} is not one of {', '.join(SCORINGS)}"
        named: list[tuple[str, object]] = [("logits", logits)]
        if fixed_ids is not None:
            named.append(("fixed_ids", fixed_ids))
        elif correction_bias is not None:  # hash routing ignores the bias, as the reference
            named.append(("correction_bias", correction_bias))
        problem = device_problem(interpreted, named)
        if problem:
            return problem
        if logits.dim() != 2 or logits.dtype not in FLOAT_DTYPES:
            return f"logits must be [T, E] float32/bfloat16/float16, got {logits.dim()}-D {logits.dtype}"
        t, e = logits.shape
        if not 1 <= e <= MAX_EXPERTS:
            return f"{e} experts: 1..{MAX_EXPERTS} are supported (a token's scores are one register row)"
        if fixed_ids is not None:
            if fixed_ids.dim() != 2 or not is_int_tensor(fixed_ids) or fixed_ids.shape[0] != t:
                got = f"{tuple(fixed_ids.shape)} {fixed_ids.dtype}"
                return f"fixed_ids must be a [T={t}, k] integer tensor, got {got}"
            k = fixed_ids.shape[1]
            if not 1 <= k <= MAX_TOP_K:
                return f"fixed_ids has {k} experts per token: 1..{MAX_TOP_K} are supported"
        else:
            if not isinstance(top_k, int) or isinstance(top_k, bool):
                return f"top_k must be an int, got {type(top_k).__name__}"
            if not 1 <= top_k <= min(e, MAX_TOP_K):
                return f"top_k {top_k}: 1..{min(e, MAX_TOP_K)} are supported with {e} experts"
            bias = correction_bias
            if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (e,)):
                return f"correction_bias must be a float32 [{e}] tensor, got {tuple(bias.shape)} {bias.dtype}"
        if not _is_number(routed_scale):
            return f"routed_scale must be a number, got {type(routed_scale).__name__}"
        return True

    return moe_route


# ---------------------------------------------------------------------------------------------
# conformance cases


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def route_cases(s: RouteShapes) -> Callable[[torch.Generator, torch.dtype], Cases]:
    """``moe_route`` cases of shapes ``s`` (see the module docstring)."""

    def cases(g: torch.Generator, dtype: torch.dtype) -> Cases:
        e, k = s.experts, s.top_k
        t_one, t_block, t_many = s.tokens

        def logits(t: int) -> torch.Tensor:
            return _randn(g, t, e, dtype=dtype, scale=2.0)

        def bias() -> torch.Tensor:
            return _randn(g, e, scale=0.3)  # float32, large enough to change the picks

        out: Cases = []
        out.append(((logits(t_one), bias(), None, k, "sqrtsoftplus", 1.5), {}))  # decode
        wide = _randn(g, t_block, e + 24, dtype=dtype, scale=2.0)  # a split of a fused projection
        out.append(((wide[:, 8 : 8 + e], bias(), None, k, "sqrtsoftplus", 1.5), {}))
        out.append(((logits(t_many), bias(), None, k, "sqrtsoftplus", 2.5), {}))
        out.append(((logits(t_block), None, None, k, "sqrtsoftplus", 1.0), {}))
        out.append(((logits(t_block), bias(), None, k, "sigmoid", 2.5), {}))
        out.append(((logits(t_many), None, None, k, "softmax", 1.0), {}))
        out.append(((logits(t_block), bias(), None, k, "softmax", 1.5), {}))
        # hash routing: ids from a token -> experts table (tid2eid[token]); top_k is ignored
        table = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(64)])
        tokens = torch.randint(0, 64, (t_block,), generator=g)
        out.append(((logits(t_block), None, table[tokens], k, "sqrtsoftplus", 1.5), {}))
        fixed = table[tokens[:t_one]].to(torch.int32)
        fixed[:, 1] = fixed[:, 0]  # a token routed twice to one expert
        out.append(((logits(t_one), bias(), fixed, 2, "sigmoid", 2.5), {}))
        # exact ties: few distinct logits (exact in every dtype), the lower expert id first
        levels = torch.randint(-4, 5, (t_block, e), generator=g).to(dtype) / 4
        out.append(((levels, None, None, k, "sqrtsoftplus", 1.5), {}))
        flat = torch.zeros(t_block, e, dtype=dtype) + torch.arange(t_block).to(dtype)[:, None] / 8
        tied = (torch.arange(e) % 5).float() * 0.125  # experts 4, 9, 14, ... tie at the top
        out.append(((flat, tied, None, k, "sigmoid", 1.0), {}))
        return out

    return cases


def routing_ops() -> dict[str, OpImpl]:
    """``{op name: OpImpl}`` for :data:`ROUTING_OPS` (imports Triton and the kernel)."""
    from deepinfer_cuda_sm100.kernels import _common, routing

    interpreted = _common.INTERPRETED
    shapes = SMALL if interpreted else V4_FLASH_LIKE
    return {
        "moe_route": OpImpl(
            fn=routing.moe_route, supports=make_supports(interpreted), sample_cases=route_cases(shapes)
        )
    }
