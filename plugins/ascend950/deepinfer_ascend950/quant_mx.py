"""MX (OCP microscaling) layouts of the checkpoint's quantised weights for the Ascend 950 MX
matmuls, and the switch that enables activation quantisation.

**Scale repetition, no re-quantisation.**  An MX operand carries one E8M0 scale (a power of two)
per 32 consecutive values along K.  A checkpoint weight of :class:`QuantizedTensor` format
``fp8`` with block ``(b_out, b_in)`` (DeepSeek-V4's 128x128, V4.1's 32x32) and ``float8_e8m0fnu``
scales is the same weight as MXFP8: each block's scale repeated over its ``b_out`` rows and its
``b_in / 32`` groups of 32 inputs gives bitwise the values ``data * scale``; the FP8 data bytes
are used as they are.  FP4 experts (format ``fp4``, one scale per 32 inputs) are MXFP4 already.
The Ascend operators take the per-32 scales *paired*: ``[rows, ceil(K / 64), 2]`` uint8, group
``j`` at ``[:, j // 2, j % 2]`` (an odd group count leaves the last pair's second byte unused).
float32 block scales are powers of two only by accident, so those weights are refused (the
reference dequantises them).

**Activation quantisation is opt-in.**  The MX matmuls multiply MX operands only: the
activations are quantised per token per 32 channels by ``npu_dynamic_mx_quant`` first
(MXFP8 e4m3, a relative error up to ``2**-4`` per element), which the op contract's tolerances do
not allow for (a quantised weight counts as its dequantised value; the activations are not
quantised).  So ``linear``, ``grouped_linear`` and ``moe_experts`` take the MX path only with
``DEEPINFER_ASCEND950_MX_ACTIVATIONS=1`` (read at each call); otherwise they leave quantised
weights to the reference (dequantised per call).  The same switch decides, when the backend is
registered, whether it declares the FP8 / FP4 formats as ``quantized_weights``
(:func:`declared_formats`): without it the engine dequantises them at load.  This is the scheme
of the public Ascend stack (MXFP8 x MXFP8 dense layers, MXFP4 experts x MXFP8 activations).
"""

from __future__ import annotations

import os
import weakref

import torch

from deepinfer_core.weights.quant import FP4_EXPERTS, FP8_BLOCK, FP8_DTYPE, UE8M0_DTYPE, QuantizedTensor

MX_ACTIVATIONS_ENV = "DEEPINFER_ASCEND950_MX_ACTIVATIONS"
"""``1``: ``linear`` / ``moe_experts`` quantise activations to MXFP8 and run the MX matmuls."""
MX_GROUP = 32
"""Values per MX scale along K."""
MX_OFF_REASON = (
    f"activation quantisation is off (set {MX_ACTIVATIONS_ENV}=1 for the MXFP8/MXFP4 matmuls, "
    "which quantise activations to MXFP8)"
)


def mx_activations_enabled() -> bool:
    """Whether :data:`MX_ACTIVATIONS_ENV` enables the MX paths (read at each call)."""
    return os.environ.get(MX_ACTIVATIONS_ENV, "0") not in ("", "0")


MX_FORMATS = (FP8_BLOCK, FP4_EXPERTS)
"""The checkpoint formats the MX ops read natively (``BackendSpec.quantized_weights``)."""


def declared_formats() -> tuple[str, ...]:
    """The ``quantized_weights`` the backend declares: :data:`MX_FORMATS` when the MX switch is
    on (read when the backend is registered), else none.  Without the switch no op of the
    backend reads a quantised weight, so keeping them quantised would only make the reference
    dequantise them at every call; with it, FP8 linears and FP4 experts stay quantised in device
    memory by default (``keep_quantized`` still overrides).  The declaration cannot see the
    checkpoint: FP8 weights with float32 block scales, which the MX ops refuse, are then kept
    quantised too and dequantised by the reference at every call (pass ``keep_quantized=False``
    for such checkpoints)."""
    return MX_FORMATS if mx_activations_enabled() else ()


def fp8_weight_problem(w: object) -> str | None:
    """Why ``w`` is not an FP8 weight the MX matmul reads, or ``None``."""
    if not isinstance(w, QuantizedTensor):
        return f"weight is a {type(w).__name__}: the MX matmul takes FP8 QuantizedTensor weights"
    if w.fmt != "fp8" or w.data.dtype != FP8_DTYPE or w.data.dim() != 2:
        return f"weight is a {w.fmt} QuantizedTensor of {w.data.dim()} dims: needs a 2-D fp8 one"
    if w.scale.dtype != UE8M0_DTYPE:
        return f"weight scales are {w.scale.dtype}: MX needs E8M0 (ue8m0) powers of two"
    if w.block[1] % MX_GROUP:
        return f"FP8 block {w.block}: its input width is not a multiple of the MX group ({MX_GROUP})"
    if w.data.shape[1] % MX_GROUP:
        return f"K={w.data.shape[1]} is not a multiple of {MX_GROUP}"
    return None


def fp4_experts_problem(w: object) -> str | None:
    """Why ``w`` is not an FP4 expert stack the MX grouped matmul reads, or ``None``."""
    if not isinstance(w, QuantizedTensor) or w.fmt != "fp4":
        return f"{type(w).__name__} experts: the MX grouped matmul takes FP4 QuantizedTensor stacks"
    if w.data.dim() != 3 or w.block != (1, MX_GROUP):
        return f"FP4 experts of {w.data.dim()} dims, block {w.block}: needs [E, out, in/2] with groups of 32"
    if w.scale.dtype != UE8M0_DTYPE:
        return f"FP4 expert scales are {w.scale.dtype}: MX needs E8M0 (ue8m0)"
    if w.data.stride(-1) != 1 or w.scale.stride(-1) != 1:
        return "FP4 expert data and scales need unit stride along the inputs"
    return None


def paired(groups: torch.Tensor) -> torch.Tensor:
    """Per-group E8M0 scales ``[..., G]`` -> the paired layout ``[..., ceil(G / 2), 2]`` uint8
    (a view when ``G`` is even; an odd ``G`` gets a zero byte in the last pair's unused half)."""
    u8 = groups.view(torch.uint8)
    if u8.shape[-1] % 2:
        u8 = torch.nn.functional.pad(u8, (0, 1))
    return u8.view(*u8.shape[:-1], u8.shape[-1] // 2, 2)


def repeat_block_scales(w: QuantizedTensor) -> torch.Tensor:
    """The per-32 E8M0 scales ``[N, ceil(K / 32)]`` (uint8) of an FP8 block-scaled weight: each
    block's scale repeated over its rows and its ``b_in / 32`` groups (see the module docstring)."""
    n, k = w.data.shape
    rows, per_block = w.block[0], w.block[1] // MX_GROUP
    s = w.scale.view(torch.uint8).repeat_interleave(rows, dim=0)[:n]
    return s.repeat_interleave(per_block, dim=1)[:, : -(-k // MX_GROUP)]


_WEIGHT_SCALES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mx_weight_scale(w: QuantizedTensor) -> torch.Tensor:
    """The paired MX scales ``[N, ceil(K / 64), 2]`` of an FP8 weight, built once per weight and
    kept while the weight lives (rebuilt if its scale tensor is replaced or written in place)."""
    key = (w.scale.data_ptr(), w.scale._version)
    hit = _WEIGHT_SCALES.get(w)
    if hit is not None and hit[0] == key:
        return hit[1]
    scale = paired(repeat_block_scales(w)).contiguous()
    _WEIGHT_SCALES[w] = (key, scale)
    return scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(MXFP8 e4m3 values [M, K], paired E8M0 scales [M, ceil(K/64), 2])`` by
    ``npu_dynamic_mx_quant`` (per row, groups of 32 along K, round to nearest even)."""
    from deepinfer_ascend950.npu import torch_npu

    return torch_npu().npu_dynamic_mx_quant(
        x.contiguous(), axis=-1, round_mode="rint", dst_type=FP8_DTYPE, block_size=MX_GROUP
    )
