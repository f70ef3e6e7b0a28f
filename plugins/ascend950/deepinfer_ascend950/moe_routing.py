"""``moe_route`` on ``torch_npu.npu_moe_gating_top_k``: learned top-k (``noaux_tc``, with the
correction bias for the selection only) and hash routing, sigmoid or sqrt-softplus scores.

Mapping of the contract onto the operator (its documented semantics: see the emulator,
``plugins/ascend950/tests/npu_emulator/moe_gating.py``):

* scoring ``sigmoid`` -> ``norm_type=1``, ``sqrtsoftplus`` -> ``norm_type=2`` (the aclnn V2 kernel);
  the operator renormalises the unbiased scores of the picks (``/ (sum + eps)``, ``eps=1e-20``)
  and multiplies by ``routed_scaling_factor``, as the contract does;
* no expert groups (``group_count = k_group = 1``);
* the correction bias is float32 in the contract and must have x's dtype for the operator, so a
  call with a bias runs the operator on float32 logits (an exact widening; the weights come back
  in the logits' dtype);
* hash routing: the contract hands over the looked-up ids ``fixed_ids [T, k]`` (the model did
  ``tid2eid[token]``); the operator's hash mode takes a table and row ids, so it gets
  ``tid2eid = fixed_ids`` and ``input_ids = arange(T)`` (row ``t`` reads its own ids), and
  gathers and renormalises the scores there.

Rejected (the reference runs them): ``softmax`` scoring (torch_npu's page documents ``renorm=0``
only, i.e. softmax weights not renormalised, which the contract requires), more than 2048
experts, hash routing with more than 64 experts per token, and non-float / wrongly shaped inputs.
"""

from __future__ import annotations

import torch

from deepinfer_ascend950.npu import torch_npu

Verdict = bool | str
Cases = list[tuple[tuple, dict]]

NORM_TYPES = {"sigmoid": 1, "sqrtsoftplus": 2}
"""Contract scoring -> the operator's ``norm_type``."""
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_EXPERTS = 2048
"""Most experts the operator takes (x's last dim)."""
MAX_HASH_K = 64
"""Most experts per token in the operator's hash mode."""
EPS = 1e-20
"""The renormalisation epsilon of the contract (and the operator's default)."""


def moe_route(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    fixed_ids: torch.Tensor | None,
    top_k: int,
    scoring: str,
    routed_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's ``moe_route`` (``deepinfer_core.ops.moe``) on ``npu_moe_gating_top_k``."""
    npu = torch_npu()
    x, bias, kwargs = logits, None, {}
    if fixed_ids is not None:
        k = fixed_ids.shape[1]
        kwargs = {
            "input_ids": torch.arange(fixed_ids.shape[0], device=logits.device),
            "tid2eid": fixed_ids,
        }
    else:
        k = top_k
        if correction_bias is not None:
            x, bias = logits.float(), correction_bias.float()
    y, idx, _ = npu.npu_moe_gating_top_k(
        x,
        k,
        bias=bias,
        k_group=1,
        group_count=1,
        group_select_mode=0,
        renorm=0,
        norm_type=NORM_TYPES[scoring],
        out_flag=False,
        routed_scaling_factor=float(routed_scale),
        eps=EPS,
        **kwargs,
    )
    return y.to(logits.dtype), idx.long()


def supports(logits, correction_bias, fixed_ids, top_k, scoring, routed_scale) -> Verdict:
    """Shapes, dtypes and arguments only (no device value is read)."""
    if scoring not in NORM_TYPES:
        return (
            f"scoring {scoring!r}: the operator renormalises sigmoid / sqrt-softplus scores only "
            "(torch_npu documents renorm=0 for softmax)"
        )
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype not in FLOAT_DTYPES:
        return "logits must be a [T, E] float32/bfloat16/float16 tensor"
    t, e = logits.shape
    if not 1 <= e <= MAX_EXPERTS:
        return f"{e} experts: the operator takes 1..{MAX_EXPERTS}"
    if isinstance(routed_scale, bool) or not isinstance(routed_scale, int | float):
        return f"routed_scale must be a number, got {type(routed_scale).__name__}"
    if fixed_ids is not None:
        if (
            fixed_ids.dim() != 2
            or fixed_ids.shape[0] != t
            or fixed_ids.dtype not in (torch.int32, torch.int64)
        ):
            return f"fixed_ids must be a [T={t}, k] int32/int64 tensor"
        if not 1 <= fixed_ids.shape[1] <= MAX_HASH_K:
            k = fixed_ids.shape[1]
            return f"hash routing with {k} experts per token: the operator takes 1..{MAX_HASH_K}"
        return True
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        return f"top_k {top_k!r} must be an int in 1..{e}"
    bias = correction_bias
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != e or not bias.is_floating_point()):
        return f"correction_bias must be a float [{e}] tensor"
    return True


def route_cases(g: torch.Generator, dtype: torch.dtype) -> Cases:
    """Cases at V4-Flash's router shape (256 experts, top-6): decode, a block and a strided
    split of a fused projection, with and without the bias, both scorings, hash routing with
    int64 and int32 ids (a token routed twice to one expert), and exact ties."""
    e, k = 256, 6

    def logits(t: int) -> torch.Tensor:
        return (torch.randn(t, e, generator=g) * 2).to(dtype)

    def bias() -> torch.Tensor:
        return torch.randn(e, generator=g) * 0.3

    wide = (torch.randn(16, e + 24, generator=g) * 2).to(dtype)
    table = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(64)])
    tokens = torch.randint(0, 64, (16,), generator=g)
    fixed = table[tokens[:3]].to(torch.int32)
    fixed[:, 1] = fixed[:, 0]
    levels = torch.randint(-4, 5, (16, e), generator=g).to(dtype) / 4
    return [
        ((logits(1), bias(), None, k, "sqrtsoftplus", 1.5), {}),
        ((wide[:, 8 : 8 + e], bias(), None, k, "sqrtsoftplus", 2.5), {}),
        ((logits(37), None, None, k, "sqrtsoftplus", 1.0), {}),
        ((logits(16), bias(), None, k, "sigmoid", 2.5), {}),
        ((logits(16), None, table[tokens], k, "sqrtsoftplus", 1.5), {}),
        ((logits(3), bias(), fixed, 2, "sigmoid", 2.5), {}),
        ((levels, None, None, k, "sqrtsoftplus", 1.5), {}),
    ]
