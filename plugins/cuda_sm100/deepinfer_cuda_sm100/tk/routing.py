"""TileKernels' ``moe_topk_gate_forward`` as ``moe_route`` with ``sqrtsoftplus`` scoring.

One warp per token: scores ``sqrt(softplus(logit))`` (``x > 20 ? x : log1p(exp(x))``, torch's
threshold), plus the ``noaux_tc`` bias for the selection only, ``top_k`` rounds of an arg-max
whose ties go to the lower expert id (the contract's stable sort), the uncorrected scores of the
picks renormalised ``w / (sum + 1e-20) * routed_scale``.  Hash routing (``fixed_ids``) goes
through the kernel's fixed-routing path: every token flagged, its ids read from
``unmapped_topk_idx`` (an int64 copy of ``fixed_ids``; the kernel writes the same ids back).

Takes **float32 logits only**: the kernel reads float32, and the contract computes the scores
in the logits' dtype, so bfloat16 logits widened for the kernel would select on unrounded
scores and could break a tie the reference sees differently.  ``sigmoid`` and ``softmax``
scoring are not in the kernel.  Experts a multiple of 4 (vector loads), ``top_k <= 32``.
"""

from __future__ import annotations

import torch

from deepinfer_cuda_sm100.tk import Adapter, ChoiceKey, Verdict, device_last, first_problem

MAX_TOP_K = 32
"""Most experts per token (one lane of the token's warp each)."""
MAX_EXPERTS = 1024
"""Most experts the adapter takes (the kernel keeps a token's scores in registers and shared memory)."""


def moe_route(logits, correction_bias, fixed_ids, top_k, scoring, routed_scale):
    """``moe_route`` through ``moe_topk_gate_forward`` (see the module docstring)."""
    from tile_kernels.moe import moe_topk_gate_forward

    logits = logits.contiguous()
    scale = float(routed_scale)
    if fixed_ids is None:
        bias = None if correction_bias is None else correction_bias.contiguous()
        ids, weights = moe_topk_gate_forward(logits, int(top_k), False, 0, scale, 0, bias=bias)
    else:
        fixed = fixed_ids.to(torch.int64, copy=True).contiguous()
        flagged = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        ids, weights = moe_topk_gate_forward(
            logits, fixed.shape[1], False, 0, scale, 0, fix_routing_mask=flagged, unmapped_topk_idx=fixed
        )
    return weights, ids


@device_last
def supports(logits, correction_bias, fixed_ids, top_k, scoring, routed_scale) -> Verdict:
    if scoring != "sqrtsoftplus":
        return f"scoring {scoring!r}: TileKernels' gate computes sqrtsoftplus only"
    ok = first_problem(
        (logits.dim() == 2, f"logits has {logits.dim()} dims, expected [T, E]"),
        (
            logits.dtype == torch.float32,
            f"logits dtype {logits.dtype}: the kernel takes float32 (the contract scores in that dtype)",
        ),
    )
    if ok is not True:
        return ok
    t, e = logits.shape
    k = fixed_ids.shape[-1] if fixed_ids is not None else top_k
    ok = first_problem(
        (
            e % 4 == 0 and 4 <= e <= MAX_EXPERTS,
            f"{e} experts: the kernel takes multiples of 4 up to {MAX_EXPERTS}",
        ),
        (
            isinstance(k, int) and 1 <= k <= min(e, MAX_TOP_K),
            f"top-k {k}: 1..{min(e, MAX_TOP_K)} are supported",
        ),
        (
            isinstance(routed_scale, int | float) and not isinstance(routed_scale, bool),
            "routed_scale is not a number",
        ),
    )
    if ok is not True or fixed_ids is None:
        if ok is True and correction_bias is not None:
            return first_problem(
                (
                    correction_bias.dtype == torch.float32 and tuple(correction_bias.shape) == (e,),
                    f"correction_bias must be float32 [{e}], got "
                    f"{tuple(correction_bias.shape)} {correction_bias.dtype}",
                )
            )
        return ok
    return first_problem(
        (
            fixed_ids.dim() == 2 and fixed_ids.shape[0] == t and not fixed_ids.is_floating_point(),
            f"fixed_ids must be an integer [T={t}, k] tensor, got {tuple(fixed_ids.shape)} {fixed_ids.dtype}",
        )
    )


def key(logits, correction_bias, fixed_ids, top_k, scoring, routed_scale) -> ChoiceKey:
    t, e = logits.shape
    if fixed_ids is not None:
        return ChoiceKey("hash", "float32", e, fixed_ids.shape[-1], t)
    return ChoiceKey("topk" if correction_bias is None else "topk+bias", "float32", e, top_k, t)


ADAPTERS = (Adapter("moe_route", moe_route, supports, key, ("moe_topk_gate_forward",), row_independent=True),)
