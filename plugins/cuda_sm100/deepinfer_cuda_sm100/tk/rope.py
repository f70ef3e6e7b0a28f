"""TileKernels' ``apply_rotary`` as ``apply_rope`` (V4's partial, interleaved RoPE).

``apply_rotary`` rotates in place a tensor whose last dim *is* the rope width, reading a float32
``[rows, R]`` cos|sin cache by position.  The contract returns a new tensor and takes per-token
``cos``, ``sin`` ``[T, R/2]``, so the adapter copies ``x`` (contiguous), concatenates ``cos`` and
``sin`` in float32 (row ``t`` for token ``t``: no position tensor) and rotates the trailing ``R``
channels of the copy with ``interleaved=True``: pairs ``(2i, 2i+1)`` turn by angle ``i``, in
float32 (``fma(a, c, -b*s)``, ``fma(a, s, b*c)``), one rounding to ``x``'s dtype.

Takes bfloat16 and float32 ``x`` (TileKernels' kernel has no float16), ``R`` of 64 or 128, and
rope slices at 16-byte offsets (vector loads).
"""

from __future__ import annotations

import torch

from deepinfer_cuda_sm100.tk import Adapter, ChoiceKey, Verdict, device_last, dtype_name, first_problem

ROPE_WIDTHS = (64, 128)
"""The rope widths ``R`` TileKernels' kernel is built for."""


def apply_rope(x, cos, sin):
    """``apply_rope`` through ``apply_rotary`` (see the module docstring)."""
    from tile_kernels.transform import apply_rotary

    r = 2 * cos.shape[-1]
    out = x.clone(memory_format=torch.contiguous_format)
    if out.shape[0]:
        rope = out[..., -r:]
        cache = torch.cat([cos, sin], dim=-1).to(torch.float32)
        apply_rotary(rope if out.dim() == 3 else rope.unsqueeze(1), cache, interleaved=True)
    return out


@device_last
def supports(x, cos, sin) -> Verdict:
    ok = first_problem(
        (
            x.dtype in (torch.bfloat16, torch.float32),
            f"x dtype {x.dtype}: TileKernels' rope takes bf16, fp32",
        ),
        (x.dim() in (2, 3), f"x has {x.dim()} dims, expected [T, D] or [T, H, D]"),
        (cos.dim() == 2 and sin.shape == cos.shape, "cos and sin must be [T, R/2] of one shape"),
    )
    if ok is not True:
        return ok
    r, d = 2 * cos.shape[-1], x.shape[-1]
    return first_problem(
        (cos.shape[0] == x.shape[0], f"cos has {cos.shape[0]} rows, x has {x.shape[0]} tokens"),
        (r in ROPE_WIDTHS, f"rope width {r}: TileKernels' kernel takes {ROPE_WIDTHS}"),
        (r <= d, f"rope width {r} exceeds x's last dim {d}"),
        (
            (d - r) * x.element_size() % 16 == 0,
            f"the rope slice starts at channel {d - r}: not 16-byte aligned",
        ),
        (d * x.element_size() % 16 == 0, f"rows of {d} channels are not 16-byte multiples"),
    )


def key(x, cos, sin) -> ChoiceKey:
    heads = x.shape[1] if x.dim() == 3 else 1
    return ChoiceKey(f"rope{2 * cos.shape[-1]}", dtype_name(x.dtype), heads, x.shape[-1], x.shape[0])


ADAPTERS = (Adapter("apply_rope", apply_rope, supports, key, ("apply_rotary",), row_independent=True),)
