"""The op table of the ``cuda_sm100`` backend: Triton kernels wrapped in ``OpImpl``.

:func:`load_ops` imports the kernel modules (and so Triton); nothing else in the package
does.  Each op has a ``supports`` predicate that looks only at shapes, dtypes, strides and
devices (never at values, so it costs no device synchronisation) and returns ``True`` or
the reason the kernel cannot take the call, and ``sample_cases`` for the shapes the kernels
target (:mod:`deepinfer_cuda_sm100.cases`).

Kernels compiled for the GPU take CUDA tensors.  With ``TRITON_INTERPRET=1`` set before the
kernel modules are imported they run in Triton's CPU interpreter and take CPU tensors
instead (the interpreter tests use this).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_core.ops import OpImpl
from deepinfer_cuda_sm100.cache_ops import CACHE_OPS
from deepinfer_cuda_sm100.checks import (
    FLOAT_DTYPES,
    Verdict,
    activation,
    device_checks,
    first_problem,
    float_dtype,
    fused_norm,
    int_vector,
    is_int_tensor,
    number,
    shape_is,
)
from deepinfer_cuda_sm100.compressor_ops import MAX_ENTRY_DIM, WINDOW_OPS
from deepinfer_cuda_sm100.embedding_ops import EMBEDDING_OPS
from deepinfer_cuda_sm100.mhc_checks import mhc_supports
from deepinfer_cuda_sm100.moe_ops import MOE_OPS
from deepinfer_cuda_sm100.plan_ops import PLAN_OPS
from deepinfer_cuda_sm100.routing_ops import ROUTING_OPS
from deepinfer_cuda_sm100.sampling_ops import SAMPLING_OPS

FUSED_OPS = (
    "rms_norm",
    "apply_rope",
    "qk_norm_rope",
    "rope_cos_sin",
    "swiglu",
    "compress_pool",
    "hc_pre",
    "hc_post",
    "hc_post_pre",
    "hc_head",
    "hc_head_norm",
)
"""The norm, rope (rotation and cos/sin tables), clamped SwiGLU, compressor pooling and mHC ops
(:mod:`~deepinfer_cuda_sm100.kernels` norm, rope, swiglu, compress_pool, mhc, mhc_chain): each
one launch (two for
``hc_pre`` / ``hc_head``, for ``hc_post_pre``, the transition between two blocks, and for
``hc_head_norm``, the final collapse with the last norm) where the
reference takes several."""

ATTENTION_OPS = ("sparse_attention", "indexer_topk")
"""The attention-side ops (:mod:`deepinfer_cuda_sm100.attention_ops`)."""

COMPRESSOR_OPS = ("compress_entries",)
"""The KV compressor's entries: pooling, norm, rope and store in one kernel
(:mod:`deepinfer_cuda_sm100.kernels.compressor`); its whole step (``compress_windows``) is in
:mod:`deepinfer_cuda_sm100.compressor_ops`."""

GEMM_OPS = ("linear", "grouped_linear")
"""The FP8 block-scaled GEMM (:mod:`deepinfer_cuda_sm100.kernels.fp8_gemm`): ``linear`` and the
grouped output projection ``grouped_linear`` (every group in one launch) with a
:class:`~deepinfer_core.weights.quant.QuantizedTensor` FP8 weight (``keep_quantized``)."""

INVARIANT_OPS = ("tile_matmul",)
"""The GEMM of batch-invariant mode (:mod:`deepinfer_cuda_sm100.kernels.tile_gemm`): with it the
reference's GEMM-bearing ops that this backend leaves to fall back are batch invariant on the GPU."""

PROVIDED_OPS = (
    FUSED_OPS
    + ATTENTION_OPS
    + COMPRESSOR_OPS
    + WINDOW_OPS
    + GEMM_OPS
    + INVARIANT_OPS
    + MOE_OPS
    + ROUTING_OPS
    + PLAN_OPS
    + SAMPLING_OPS
    + CACHE_OPS
    + EMBEDDING_OPS
)
"""The ops this backend implements (every other op falls back to the reference, logged)."""

PLAIN_WEIGHT_REFUSAL = "plain tensor weight: cuBLAS (the reference) runs dense GEMMs"
"""``linear``'s reason for a plain-tensor weight the dense GEMV does not take
(:func:`deepinfer_cuda_sm100.gemm_dispatch.dense_refusal`: where the measured table found it
faster, e.g. the LM head at decode widths; the rest is the reference's cuBLAS GEMM)."""


def make_supports(interpreted: bool) -> dict[str, Callable[..., Verdict]]:
    """The ``supports`` predicates, for kernels that are ``interpreted`` (CPU) or compiled (CUDA)."""

    def rms_norm(x, weight, eps) -> Verdict:
        dev = device_checks(interpreted, x=x, weight=weight)
        if dev is not True:
            return dev
        checks = [activation("x", x), (x.dim() >= 1, "x is a 0-dim tensor")]
        if weight is not None and x.dim() >= 1:
            checks += [float_dtype("weight", weight), shape_is("weight", weight, (x.shape[-1],))]
        return first_problem(*checks)

    def apply_rope(x, cos, sin) -> Verdict:
        dev = device_checks(interpreted, x=x, cos=cos, sin=sin)
        if dev is not True:
            return dev
        ok = first_problem(
            activation("x", x),
            (x.dim() in (2, 3), f"x has {x.dim()} dims, expected [T, D] or [T, H, D]"),
            float_dtype("cos", cos),
            float_dtype("sin", sin),
            (cos.dim() == 2, f"cos has {cos.dim()} dims, expected [T, R/2]"),
        )
        if ok is not True:
            return ok
        t, half = x.shape[0], cos.shape[1]
        return first_problem(
            shape_is("cos", cos, (t, half)),
            shape_is("sin", sin, (t, half)),
            (half >= 1, "cos has no rotated pair (R = 0)"),
            (2 * half <= x.shape[-1], f"rope width {2 * half} exceeds x's last dim {x.shape[-1]}"),
        )

    def qk_norm_rope(q, kv, kv_weight, eps, cos, sin, norm_q=True) -> Verdict:
        dev = device_checks(interpreted, q=q, kv=kv, kv_weight=kv_weight, cos=cos, sin=sin)
        if dev is not True:
            return dev
        ok = first_problem(
            activation("q", q),
            (q.dim() == 3, f"q has {q.dim()} dims, expected [T, H, D]"),
            (kv.dim() == 2, f"kv has {kv.dim()} dims, expected [T, D]"),
            (kv.dtype == q.dtype, f"kv dtype {kv.dtype} differs from q dtype {q.dtype}"),
            (cos.dim() == 2 and sin.dim() == 2, "cos / sin are not [T, R/2] tables"),
            (isinstance(norm_q, bool), f"norm_q is a {type(norm_q).__name__}, not a bool"),
        )
        if ok is not True:
            return ok
        t, _, d = q.shape
        half = cos.shape[1]
        return first_problem(
            shape_is("kv", kv, (t, d)),
            shape_is("cos", cos, (t, half)),
            shape_is("sin", sin, (t, half)),
            float_dtype("cos", cos),
            float_dtype("sin", sin),
            (half >= 1, "cos has no rotated pair (R = 0)"),
            (2 * half <= d, f"rope width {2 * half} exceeds the rows' {d} channels"),
            *fused_norm(d, "kv_weight", kv_weight),
        )

    def rope_cos_sin(positions, inv_freq, scale, dtype) -> Verdict:
        dev = device_checks(interpreted, positions=positions, inv_freq=inv_freq)
        if dev is not True:
            return dev
        return first_problem(
            (
                is_int_tensor(positions) and positions.dim() == 1,
                f"positions ({positions.dtype}, {positions.dim()} dims) is not a [T] integer tensor",
            ),
            float_dtype("inv_freq", inv_freq),
            (inv_freq.dim() == 1, f"inv_freq has {inv_freq.dim()} dims, expected [R/2]"),
            number("scale", scale),
            (dtype in FLOAT_DTYPES, f"dtype {dtype} is not one of float32, bfloat16, float16"),
        )

    def swiglu(gate, up, limit) -> Verdict:
        dev = device_checks(interpreted, gate=gate, up=up)
        if dev is not True:
            return dev
        ok = first_problem(
            activation("gate", gate),
            (gate.dim() == 2, f"gate has {gate.dim()} dims, expected [T, I]"),
            (up.dtype == gate.dtype, f"up dtype {up.dtype} differs from gate dtype {gate.dtype}"),
            number("limit", limit),
        )
        if ok is not True:
            return ok
        return first_problem(shape_is("up", up, tuple(gate.shape)))

    def compress_pool(kv, gate) -> Verdict:
        dev = device_checks(interpreted, kv=kv, gate=gate)
        if dev is not True:
            return dev
        ok = first_problem(
            activation("kv", kv),
            (kv.dim() == 3, f"kv has {kv.dim()} dims, expected [M, L, D]"),
            (gate.dtype == torch.float32, f"gate dtype {gate.dtype} is not float32"),
        )
        if ok is not True:
            return ok
        return first_problem(shape_is("gate", gate, tuple(kv.shape)))

    def compress_entries(
        kv, gate, norm_weight, eps, positions, inv_freq, rope_scale, pool, dest, live=None
    ) -> Verdict:
        if not isinstance(pool, torch.Tensor):
            return (
                f"pool is a {type(pool).__name__}: the kernel stores into plain tensor pools "
                "(packed formats take the reference)"
            )
        dev = device_checks(
            interpreted,
            kv=kv,
            gate=gate,
            norm_weight=norm_weight,
            positions=positions,
            inv_freq=inv_freq,
            pool=pool,
            dest=dest,
            **({} if live is None else {"live": live}),
        )
        if dev is not True:
            return dev
        ok = first_problem(
            activation("kv", kv),
            (kv.dim() == 3, f"kv has {kv.dim()} dims, expected [M, L, D]"),
            activation("pool", pool),
            (pool.dim() == 2, f"pool has {pool.dim()} dims, expected [N, D]"),
            float_dtype("norm_weight", norm_weight),
            float_dtype("inv_freq", inv_freq),
            (inv_freq.dim() == 1, f"inv_freq has {inv_freq.dim()} dims, expected [R/2]"),
        )
        if ok is not True:
            return ok
        m, length, d = kv.shape
        ok = first_problem(
            (gate.dtype == torch.float32, f"gate dtype {gate.dtype} is not float32"),
            shape_is("gate", gate, (m, length, d)),
            (length >= 1, "kv has windows of no rows (L = 0)"),
            (
                d % 2 == 0 and 2 <= d <= MAX_ENTRY_DIM,
                f"entry width D={d} is not even in [2, {MAX_ENTRY_DIM}]",
            ),
            shape_is("norm_weight", norm_weight, (d,)),
            (1 <= 2 * inv_freq.shape[0] <= d, f"rope width {2 * inv_freq.shape[0]} is not in [2, D={d}]"),
            (pool.shape[1] == d, f"pool rows have {pool.shape[1]} channels, expected D={d}"),
            (pool.stride(1) == 1, f"pool has channel stride {pool.stride(1)}, expected 1"),
        )
        if ok is not True:
            return ok
        for name, t, n in (("positions", positions, m), ("dest", dest, m), ("live", live, 1)):
            ok = True if t is None else int_vector(name, t, n)
            if ok is not True:
                return ok
        return True

    def linear(x, weight) -> Verdict:
        from deepinfer_core.weights.quant import FP8_DTYPE, QuantizedTensor

        if not isinstance(weight, QuantizedTensor):
            from deepinfer_cuda_sm100.gemm_dispatch import dense_refusal

            return PLAIN_WEIGHT_REFUSAL if dense_refusal(x, weight, interpreted) else True
        if weight.fmt != "fp8" or tuple(weight.block) != (128, 128):
            return f"weight is a {weight.fmt} QuantizedTensor with block {weight.block}: needs fp8 128x128"
        dev = device_checks(interpreted, x=x, weight=weight.data, scale=weight.scale)
        if dev is not True:
            return dev
        ok = first_problem(
            activation("x", x),
            (x.dim() >= 1, "x is a 0-dim tensor"),
            (weight.data.dim() == 2, f"weight has {weight.data.dim()} dims, expected [N, K]"),
            (weight.data.dtype == FP8_DTYPE, f"weight data dtype {weight.data.dtype} is not float8_e4m3fn"),
        )
        if ok is not True:
            return ok
        n, k = weight.data.shape
        return first_problem(
            (x.shape[-1] == k, f"x has {x.shape[-1]} channels, the weight takes K={k}"),
            (x.stride(-1) == 1 or x.shape[-1] <= 1, f"x has channel stride {x.stride(-1)}, expected 1"),
            (k % 16 == 0 and k > 0, f"K={k} is not a positive multiple of 16"),
            (n % 16 == 0 and n > 0, f"N={n} is not a positive multiple of 16"),
            (weight.data.stride(-1) == 1, f"weight data has stride {weight.data.stride(-1)} along K"),
        )

    def grouped_linear(x, weight) -> Verdict:
        from deepinfer_core.weights.quant import QuantizedTensor

        if not isinstance(weight, QuantizedTensor):  # the reference's batched GEMM
            return PLAIN_WEIGHT_REFUSAL
        if x.dim() != 3:
            return f"x has {x.dim()} dims, expected [T, G, K]"
        ok = linear(x[:, 0], weight)
        if ok is not True:
            return ok
        rows, groups = weight.data.shape[0], x.shape[1]
        return first_problem(
            (groups >= 1 and rows % groups == 0, f"weight rows {rows} do not split into G={groups} groups"),
            (
                groups >= 1 and (rows // max(groups, 1)) % 128 == 0,
                f"group width N={rows // max(groups, 1)} is not a multiple of 128",
            ),
        )

    def tile_matmul(a, b) -> Verdict:
        dev = device_checks(interpreted, a=a, b=b)
        if dev is not True:
            return dev
        ok = first_problem(
            activation("a", a),
            (a.dim() == 3, f"a has {a.dim()} dims, expected [n, R, K]"),
            (b.dim() == 3, f"b has {b.dim()} dims, expected [n, N, K]"),
            (b.dtype == a.dtype, f"b dtype {b.dtype} differs from a dtype {a.dtype}"),
        )
        if ok is not True:
            return ok
        return first_problem(
            (b.shape[0] == a.shape[0], f"b has {b.shape[0]} items, a has {a.shape[0]}"),
            (b.shape[2] == a.shape[2], f"b has K={b.shape[2]}, a has K={a.shape[2]}"),
        )

    return {
        **mhc_supports(interpreted),
        "tile_matmul": tile_matmul,
        "linear": linear,
        "grouped_linear": grouped_linear,
        "rms_norm": rms_norm,
        "apply_rope": apply_rope,
        "qk_norm_rope": qk_norm_rope,
        "rope_cos_sin": rope_cos_sin,
        "swiglu": swiglu,
        "compress_pool": compress_pool,
        "compress_entries": compress_entries,
    }


def load_ops() -> dict[str, OpImpl]:
    """``{op name: OpImpl}`` for :data:`PROVIDED_OPS` (imports Triton and the kernels)."""
    from deepinfer_cuda_sm100 import cases
    from deepinfer_cuda_sm100.gemm_dispatch import make_grouped_linear, make_linear
    from deepinfer_cuda_sm100.kernels import (
        _common,
        compress_pool,
        compressor,
        fp8_gemm,
        mhc,
        mhc_chain,
        norm,
        qk_norm_rope,
        rope,
        swiglu,
        tile_gemm,
    )

    interpreted = _common.INTERPRETED
    supports = make_supports(interpreted)
    own = cases.own_cases(cases.SMALL if interpreted else cases.V4_FLASH)
    fns = {
        "rms_norm": norm.rms_norm,
        "apply_rope": rope.apply_rope,
        "qk_norm_rope": qk_norm_rope.qk_norm_rope,
        "rope_cos_sin": rope.rope_cos_sin,
        "swiglu": swiglu.swiglu,
        "compress_pool": compress_pool.compress_pool,
        "hc_pre": mhc.hc_pre,
        "hc_post": mhc.hc_post,
        "hc_post_pre": mhc_chain.hc_post_pre,
        "hc_head_norm": mhc_chain.hc_head_norm,
        "hc_head": mhc.hc_head,
        "compress_entries": compressor.compress_entries,
        "linear": make_linear(fp8_gemm.linear_fp8),  # dequantise + cuBLAS where measured faster
        "grouped_linear": make_grouped_linear(fp8_gemm.grouped_linear_fp8),
        "tile_matmul": tile_gemm.tile_matmul,
    }
    from deepinfer_cuda_sm100.attention_ops import attention_ops

    impls = {
        name: OpImpl(fn=fns[name], supports=supports[name], sample_cases=own[name])
        for name in FUSED_OPS + COMPRESSOR_OPS + GEMM_OPS + INVARIANT_OPS
    }
    from deepinfer_cuda_sm100.cache_ops import cache_ops
    from deepinfer_cuda_sm100.compressor_ops import compressor_ops
    from deepinfer_cuda_sm100.embedding_ops import embedding_ops
    from deepinfer_cuda_sm100.moe_ops import moe_ops
    from deepinfer_cuda_sm100.plan_ops import plan_ops
    from deepinfer_cuda_sm100.routing_ops import routing_ops
    from deepinfer_cuda_sm100.sampling_ops import sampling_ops

    return {
        **impls,
        **attention_ops(),
        **compressor_ops(),
        **moe_ops(),
        **routing_ops(),
        **plan_ops(),
        **sampling_ops(),
        **cache_ops(),
        **embedding_ops(),
    }
