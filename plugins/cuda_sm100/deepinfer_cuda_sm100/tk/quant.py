"""TileKernels' ``per_token_cast_and_cast_back`` as V4.1's ``deepseek_v41.kv_qdq`` (UE8M0 formats).

``per_token_cast_and_cast_back(x, fmt, block, round_sf=True)`` quantises and dequantises ``x``
in place, per ``block`` channels one power-of-two scale: ``s = 2**ceil(log2(max(amax, floor) *
(1 / qmax)))`` with TileKernels' default floors (``1e-4`` for e4m3, ``6 * 2**-126`` for e2m1:
the release's), ``x * (1/s)`` cast to e4m3 or e2m1 (round to nearest even), times ``s``, cast to
``x``'s dtype.  With a power-of-two scale ``x * (1/s)`` is ``x / s`` exactly, so the result is
bit for bit the contract's ``fp8_ue8m0`` and ``fp4_ue8m0`` (the GPU tests check it).  The adapter
copies ``x`` first (the contract returns a new tensor).

``fp4_e4m3`` is left out: TileKernels scales by ``x * (1 / s8)`` with an e4m3 scale ``s8``
that is not a power of two, which rounds differently from the contract's ``x / s8`` and can flip
an e2m1 code at a rounding boundary.
"""

from __future__ import annotations

import torch

from deepinfer_cuda_sm100.tk import Adapter, ChoiceKey, Verdict, device_last, dtype_name, first_problem

FORMATS = {"fp8_ue8m0": "e4m3", "fp4_ue8m0": "e2m1"}
"""The contract's formats the adapter takes -> TileKernels' element format."""
BLOCKS = (16, 32, 64, 128)
"""The channels per scale TileKernels' kernel is built for."""


def kv_qdq(x, fmt, block):
    """``deepseek_v41.kv_qdq`` through ``per_token_cast_and_cast_back`` (see the module docstring)."""
    from tile_kernels.quant import per_token_cast_and_cast_back

    out = x.clone(memory_format=torch.contiguous_format)
    if out.numel():
        per_token_cast_and_cast_back(out.view(-1, x.shape[-1]), FORMATS[fmt], int(block), round_sf=True)
    return out


@device_last
def supports(x, fmt, block) -> Verdict:
    if fmt not in FORMATS:
        return f"format {fmt!r}: the adapter takes {', '.join(FORMATS)} (fp4_e4m3 rounds differently)"
    n = x.shape[-1] if x.dim() else 0
    return first_problem(
        (
            x.dtype in (torch.bfloat16, torch.float32),
            f"x dtype {x.dtype}: the adapter takes bfloat16, float32",
        ),
        (block in BLOCKS, f"block {block}: TileKernels' kernel takes {BLOCKS}"),
        (
            n > 0 and n % 64 == 0 and n % block == 0,
            f"last dim {n}: TileKernels' kernel takes multiples of 64 and of the block",
        ),
    )


def key(x, fmt, block) -> ChoiceKey:
    n = x.shape[-1]
    return ChoiceKey(fmt, dtype_name(x.dtype), block, n, x.numel() // n)


ADAPTERS = (
    Adapter(
        "deepseek_v41.kv_qdq", kv_qdq, supports, key, ("per_token_cast_and_cast_back",), row_independent=True
    ),
)
