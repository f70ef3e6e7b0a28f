"""EMULATOR of torch_npu's MX matmuls: ``npu_quant_matmul`` (MXFP8 dense) and
``npu_grouped_matmul`` (per-expert groups of rows, MXFP8 activations x MXFP8/MXFP4 weights).
Tests only; see the package docstring.  Only the MX mode the ascend950 backend uses is emulated;
any other argument combination raises ``NotImplementedError`` naming it.

Documents followed (facts, not code):

* M1 ``matmul/quant_batch_matmul_v4/docs/aclnnQuantMatmulV5.md`` in cann/ops-nn (the kernel of
  ``npu_quant_matmul`` on Ascend 950): mx mode ``out[m, n] = sum_j (x1 slice . x2 slice) *
  x1Scale[m, j] * x2Scale[j, n] + bias[n]`` over K slices of 32 (``[gsM, gsN, gsK] = [1, 1,
  32]``); x1 ``(m, k)`` with x1Scale ``(m, ceil(k/64), 2)``; x2 ``(k, n)`` with x2Scale
  ``(ceil(k/64), n, 2)``, or transposed ``(n, k)`` with ``(n, ceil(k/64), 2)``, "x2 and x2Scale
  must have the same transposition"; FLOAT8_E8M0 scales; bias FLOAT32; out FLOAT16 / BFLOAT16 /
  FLOAT32;
* M2 ``op_plugin/config/op_plugin_functions.yaml`` in Ascend/op-plugin: the torch_npu signatures
  (``npu_quant_matmul(x1, x2, scale, *, offset, pertoken_scale, bias, output_dtype, x1_dtype,
  x2_dtype, pertoken_scale_dtype, scale_dtype, group_sizes, y_scale)`` and ``npu_grouped_matmul(x,
  weight, *, bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, group_list,
  ..., split_item, group_type, group_list_type, act_type, tuning_config, output_dtype, x_dtype,
  weight_dtype, scale_dtype, per_token_scale_dtype)``);
* M3 ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_grouped_matmul.md`` in Ascend/op-plugin:
  single-tensor x / weight / y with ``split_item`` 2 or 3, ``group_type`` 0 (groups along m),
  ``group_list_type`` 0 (cumulative ends) or 1 (counts) summing to x's rows, at most 1024 groups;
* M4 the MX scale layouts of the grouped-matmul family on Ascend 950 (the ``weight_scale`` /
  ``x_scale`` sections of the grouped-matmul-with-routing pages in cann/ops-transformer): weight
  ``(e, k, n)`` with scale ``(e, ceil(k/64), n, 2)``, transposed ``(e, n, k)`` with ``(e, n,
  ceil(k/64), 2)``; x scale ``(m, ceil(k/64), 2)``; FP4 weights given as 8-bit storage with
  ``weight_dtype=torch_npu.float4_e2m1fn_x2``, two values a byte along the contiguous axis.

Where documents are silent: the torch_npu page of ``npu_grouped_matmul`` (M3) does not describe
the MX mode at all, so its MX arguments follow M2's signature and M4's layouts; the summation
order inside a 32-slice and across slices (the emulator dequantises and multiplies in float32,
exact for the products, with PyTorch's reduction order); the padding half of an odd last scale
pair (ignored).
"""

from __future__ import annotations

import torch

from .moe_mx import decode_e2m1, expand_groups, is_e8m0, is_fp4, is_fp8_e4m3, mx_group_scales, unpack_fp4_last

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_group_sizes(group_sizes) -> None:
    if group_sizes not in (None, [1, 1, 32], (1, 1, 32), [0, 0, 0], (0, 0, 0)):
        raise NotImplementedError(f"EMULATOR: group_sizes {group_sizes} (mx mode takes [1, 1, 32])")


def _transposed(t: torch.Tensor, a: int, b: int) -> bool | None:
    """Whether dims ``a`` (rows) and ``b`` (columns) of ``t`` are stored column-major (a ``.t()``
    view); ``None`` when a size-1 dim leaves the strides ambiguous."""
    if t.shape[a] == 1 or t.shape[b] == 1:
        return None
    return t.stride(a) < t.stride(b)


def _same_transposition(t: torch.Tensor, s: torch.Tensor, a: int, b: int) -> bool:
    """An operand and its scale are stored alike (either ambiguous counts as alike)."""
    ta, ts = _transposed(t, a, b), _transposed(s, a, b)
    return ta is None or ts is None or ta == ts


def npu_quant_matmul(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    *,
    offset: torch.Tensor | None = None,
    pertoken_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    output_dtype=None,
    x1_dtype=None,
    x2_dtype=None,
    pertoken_scale_dtype=None,
    scale_dtype=None,
    group_sizes=None,
    y_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """EMULATOR: the MXFP8 mode of ``npu_quant_matmul`` (M1, M2): ``x1 [m, k]`` and ``x2 [k, n]``
    float8_e4m3fn, ``pertoken_scale [m, ceil(k/64), 2]`` and ``scale [ceil(k/64), n, 2]`` uint8
    E8M0 (``scale_dtype`` / ``pertoken_scale_dtype`` = ``torch_npu.float8_e8m0fnu``), optional
    float32 ``bias [n]``; returns ``[m, n]`` in ``output_dtype`` (float16, bfloat16 or float32).

    ``x2`` may be a transposed view of an ``(n, k)`` tensor; then ``scale`` must be the
    transposed view of an ``(n, ceil(k/64), 2)`` tensor too (M1: same transposition), which is
    checked.  Products are formed exactly in float32 from the dequantised operands.
    """
    if offset is not None or y_scale is not None or x1_dtype is not None or x2_dtype is not None:
        raise NotImplementedError("EMULATOR: npu_quant_matmul without offset / y_scale / x*_dtype only")
    if not (is_fp8_e4m3(x1.dtype) and is_fp8_e4m3(x2.dtype)):
        raise NotImplementedError(
            f"EMULATOR: npu_quant_matmul mx mode with float8_e4m3fn x1/x2, got {x1.dtype}"
        )
    if pertoken_scale is None or not (is_e8m0(scale_dtype) and is_e8m0(pertoken_scale_dtype)):
        raise NotImplementedError("EMULATOR: npu_quant_matmul mx mode needs E8M0 scale and pertoken_scale")
    _check_group_sizes(group_sizes)
    if x1.dim() != 2 or x2.dim() != 2 or x1.shape[1] != x2.shape[0]:
        raise RuntimeError(
            f"npu_quant_matmul: x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} are not [m, k] x [k, n]"
        )
    m, k = x1.shape
    n = x2.shape[1]
    pairs = -(-k // 64)
    if tuple(pertoken_scale.shape) != (m, pairs, 2) or tuple(scale.shape) != (pairs, n, 2):
        raise RuntimeError(
            f"npu_quant_matmul: scales {tuple(pertoken_scale.shape)} / {tuple(scale.shape)}, expected "
            f"({m}, {pairs}, 2) / ({pairs}, {n}, 2)"
        )
    if not _same_transposition(x2, scale, 0, 1):
        raise RuntimeError("npu_quant_matmul: x2 and scale must have the same transposition")
    out_dtype = torch.int8 if output_dtype is None else output_dtype
    if out_dtype not in _OUT_DTYPES:
        raise NotImplementedError(f"EMULATOR: mx output_dtype {out_dtype}")
    groups = -(-k // 32)
    a = expand_groups(x1.float(), mx_group_scales(pertoken_scale, groups))
    w_scale = mx_group_scales(scale.permute(1, 0, 2), groups)  # [n, groups]
    b = expand_groups(x2.float().t(), w_scale)  # [n, k]
    out = a @ b.t()
    if bias is not None:
        if bias.dtype != torch.float32:
            raise RuntimeError("npu_quant_matmul: mx mode takes a float32 bias")
        out = out + bias
    return out.to(out_dtype)


def _weights_mx(w: torch.Tensor, scale: torch.Tensor, fp4: bool) -> torch.Tensor:
    """The dequantised float32 weight ``[e, k, n]`` of an MX weight ``[e, k(/2), n]`` and its scale
    ``[e, ceil(k/64), n, 2]`` (either may be a transposed view of the ``(e, n, ...)`` layout)."""
    if fp4:
        inner_k = w.stride(1) == 1  # the bytes pack two k values (storage (e, n, k/2))
        if inner_k:
            values = decode_e2m1(unpack_fp4_last(w.transpose(1, 2))).transpose(1, 2)
        else:
            values = decode_e2m1(unpack_fp4_last(w))
    else:
        values = w.float()
    e, k, n = values.shape
    if tuple(scale.shape) != (e, -(-k // 64), n, 2):
        raise RuntimeError(
            f"npu_grouped_matmul: weight scale {tuple(scale.shape)}, expected ({e}, {-(-k // 64)}, {n}, 2)"
        )
    if not _same_transposition(w, scale, 1, 2):
        raise RuntimeError("npu_grouped_matmul: weight and its scale must have the same transposition")
    s = mx_group_scales(scale.permute(0, 2, 1, 3), -(-k // 32))  # [e, n, groups]
    return expand_groups(values.transpose(1, 2), s).transpose(1, 2)


def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list: torch.Tensor | None = None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item: int = 0,
    group_type: int | None = None,
    group_list_type: int = 0,
    act_type: int = 0,
    tuning_config=None,
    output_dtype=None,
    x_dtype=None,
    weight_dtype=None,
    scale_dtype=None,
    per_token_scale_dtype=None,
) -> list[torch.Tensor]:
    """EMULATOR: the MX mode of ``npu_grouped_matmul`` with single tensors (M2, M3, M4).

    ``x = [x0 [m, k] float8_e4m3fn]`` with ``per_token_scale = [[m, ceil(k/64), 2]]``;
    ``weight = [w [e, k, n]]``, float8_e4m3fn, or 8-bit storage of packed FP4 with
    ``weight_dtype=torch_npu.float4_e2m1fn_x2`` (``[e, k/2, n]`` as the transposed view of
    ``(e, n, k/2)`` bytes, or ``[e, k, n/2]``), with ``scale = [[e, ceil(k/64), n, 2]]``; both
    scales uint8 E8M0 (``scale_dtype`` / ``per_token_scale_dtype`` = ``float8_e8m0fnu``).
    ``group_list`` (``group_list_type`` 1: rows per group; 0: cumulative ends) assigns x's rows,
    in order, to the ``e`` weights and must cover all of them (M3).  ``split_item`` 2 or 3,
    ``group_type`` 0.  Returns ``[y [m, n]]`` in ``output_dtype``.
    """
    unsupported = (bias, offset, antiquant_scale, antiquant_offset, activation_input, activation_quant_scale)
    if any(a is not None for a in unsupported) or act_type or x_dtype is not None:
        raise NotImplementedError(
            "EMULATOR: npu_grouped_matmul MX mode without bias/offset/antiquant/activation"
        )
    if len(x) != 1 or len(weight) != 1 or split_item not in (2, 3) or group_type != 0:
        raise NotImplementedError("EMULATOR: single-tensor x / weight / y, split_item 2|3, group_type 0")
    if (
        scale is None
        or per_token_scale is None
        or not (is_e8m0(scale_dtype) and is_e8m0(per_token_scale_dtype))
    ):
        raise NotImplementedError("EMULATOR: npu_grouped_matmul MX mode needs E8M0 scale and per_token_scale")
    x0, w = x[0], weight[0]
    if not is_fp8_e4m3(x0.dtype) or x0.dim() != 2:
        raise NotImplementedError(f"EMULATOR: MX x must be 2-D float8_e4m3fn, got {x0.dtype}")
    fp4 = is_fp4(weight_dtype)
    if not fp4 and not is_fp8_e4m3(w.dtype):
        raise NotImplementedError(f"EMULATOR: MX weight float8_e4m3fn or float4_e2m1fn_x2, got {w.dtype}")
    w_full = _weights_mx(w, scale[0], fp4)
    e, k, n = w_full.shape
    m = x0.shape[0]
    if x0.shape[1] != k:
        raise RuntimeError(f"npu_grouped_matmul: x has k={x0.shape[1]}, weight k={k}")
    if tuple(per_token_scale[0].shape) != (m, -(-k // 64), 2):
        raise RuntimeError(f"npu_grouped_matmul: per_token_scale {tuple(per_token_scale[0].shape)}")
    if group_list is None or group_list.dim() != 1 or group_list.shape[0] != e or e > 1024:
        raise RuntimeError(f"npu_grouped_matmul: group_list must be 1-D of the {e} groups (at most 1024)")
    counts = (
        group_list.long()
        if group_list_type == 1
        else torch.diff(group_list.long(), prepend=group_list.new_zeros(1))
    )
    if group_list_type not in (0, 1) or (counts < 0).any() or int(counts.sum()) != m:
        raise RuntimeError("npu_grouped_matmul: group_list must be non-negative and cover x's rows")
    out_dtype = output_dtype if output_dtype is not None else torch.bfloat16
    if out_dtype not in _OUT_DTYPES:
        raise NotImplementedError(f"EMULATOR: MX output_dtype {out_dtype}")
    a = expand_groups(x0.float(), mx_group_scales(per_token_scale[0], -(-k // 32)))
    group_of_row = torch.repeat_interleave(torch.arange(e), counts)
    y = torch.bmm(a.unsqueeze(1), w_full.index_select(0, group_of_row)).squeeze(1)
    return [y.to(out_dtype)]


FUNCTIONS = {"npu_quant_matmul": npu_quant_matmul, "npu_grouped_matmul": npu_grouped_matmul}
