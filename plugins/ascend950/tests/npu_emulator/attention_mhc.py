"""EMULATOR of the ``torch_npu`` mHC operators: ``npu_mhc_pre``, ``npu_mhc_sinkhorn`` and
``npu_mhc_post``.  Tests only.

Sources (Ascend/op-plugin, branch master as mirrored, ``docs/zh/custom_APIs/torch_npu/``):
``torch_npu-npu_mhc_pre.md``, ``torch_npu-npu_mhc_sinkhorn.md``, ``torch_npu-npu_mhc_post.md``.
Where they disagree or are silent, it is said at the function.  Computed in float32; ``h_in``
and ``npu_mhc_post``'s output rounded once to ``x``'s dtype.
"""

from __future__ import annotations

import torch

_FLOAT16S = (torch.bfloat16, torch.float16)
_STREAMS = (4, 6, 8)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"EMULATOR torch_npu: {message}")


def npu_mhc_pre(x, phi, alpha, bias, *, gamma=None, norm_eps=1e-6, hc_eps=1e-6, out_flag=0, inner_precise=0):
    """EMULATOR of ``torch_npu.npu_mhc_pre`` (doc: ``torch_npu-npu_mhc_pre.md``).

    ``x`` ``[T, n, D]`` (bfloat16 / float16), ``phi`` float32 ``[n²+2n, nD]`` (rows: W_pre,
    W_post, W_res) or ``[2n, nD]``, ``alpha`` ``[3]`` / ``[2]``, ``bias`` matching ``phi``'s rows.
    ``x' = RmsNorm(flatten(x))`` (times ``gamma`` when given), ``H = alpha_g * (x' @ phi_g.T) + b_g``
    per group, ``H_pre = sigmoid(.) + hc_eps``, ``H_post = 2 sigmoid(.)``, ``h_in = sum_n H_pre[n] x[n]``.
    Returns ``(h_in, h_post, h_res, inv_rms, h_mix, h_pre)``; the last three only with
    ``out_flag=1`` (else ``None``).

    Where the doc is inconsistent or silent, chosen here: ``h_post`` is ``[T, n]`` (the return
    table says ``(T, D)``, which contradicts the formula); ``h_res`` is the un-normalised
    ``[T, n, n]`` with row ``i*n + j`` of the W_res block at ``[i, j]`` (row-major; the doc gives
    no order) and is all zeros for ``alpha`` of 2 entries; ``gamma`` is ``[n, D]`` applied to the
    flattened normed row; ``inner_precise`` (FP32 / HF32 cube) changes nothing here (float32).
    """
    _require(x.dtype in _FLOAT16S, f"x dtype {x.dtype}: bfloat16 or float16")
    _require(x.dim() == 3, "x must be [T, n, D] (the BSnD form is not emulated)")
    t, n, d = x.shape
    _require(n in _STREAMS, f"n must be one of {_STREAMS}, got {n}")
    _require(1 <= d <= 16384 and d % 16 == 0, f"D must be a multiple of 16 in 1..16384, got {d}")
    _require(alpha.numel() in (2, 3), "alpha must have 2 or 3 entries")
    rows = n * n + 2 * n if alpha.numel() == 3 else 2 * n
    _require(
        tuple(phi.shape) == (rows, n * d) and phi.dtype == torch.float32, f"phi must be float32 [{rows}, nD]"
    )
    _require(tuple(bias.shape) == (rows,), f"bias must be [{rows}]")
    flat = x.reshape(t, n * d).float()
    inv_rms = torch.rsqrt(flat.square().mean(dim=-1) + norm_eps)
    normed = flat * inv_rms.unsqueeze(-1)
    if gamma is not None:
        normed = normed * gamma.float().reshape(1, n * d)
    h_mix = normed @ phi.float().T  # [T, rows]
    a = alpha.float()
    group_scale = torch.cat(
        [a[0].expand(n), a[1].expand(n), a[2].expand(rows - 2 * n) if rows > 2 * n else a[:0]]
    )
    h = h_mix * group_scale + bias.float()
    h_pre = torch.sigmoid(h[:, :n]) + hc_eps
    h_post = 2 * torch.sigmoid(h[:, n : 2 * n])
    h_res = h[:, 2 * n :].reshape(t, n, n) if rows > 2 * n else h.new_zeros(t, n, n)
    h_in = (h_pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
    if out_flag:
        return h_in, h_post, h_res, inv_rms, h_mix, h_pre
    return h_in, h_post, h_res, None, None, None


def npu_mhc_sinkhorn(x, eps=1e-6, num_iters=20, out_flag=0):
    """EMULATOR of ``torch_npu.npu_mhc_sinkhorn`` (doc: ``torch_npu-npu_mhc_sinkhorn.md``).

    ``y0 = softmax(x, dim=-1) + eps``; then ``y = y / (sum(y, dim=-2) + eps)`` (columns); then
    ``num_iters - 1`` rounds of rows (``dim=-1``) then columns, each ``y / (sum + eps)``.  ``x``
    float32 ``[T, n, n]`` with n in {4, 6, 8}; ``num_iters`` in [1, 100].  Returns
    ``(y, norm_out, sum_out)``; the intermediate outputs (for the backward) are not emulated and
    come back ``None``, so ``out_flag`` must be 0.
    """
    _require(out_flag == 0, "out_flag=1 (intermediate outputs) is not emulated")
    _require(x.dtype == torch.float32, f"x dtype {x.dtype}: float32")
    _require(
        x.dim() in (3, 4) and x.shape[-1] == x.shape[-2] and x.shape[-1] in _STREAMS, "x must be [.., n, n]"
    )
    _require(1 <= num_iters <= 100, f"num_iters {num_iters} is not in [1, 100]")
    y = torch.softmax(x, dim=-1) + eps
    y = y / (y.sum(dim=-2, keepdim=True) + eps)
    for _ in range(num_iters - 1):
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
        y = y / (y.sum(dim=-2, keepdim=True) + eps)
    return y, None, None


def npu_mhc_post(x, h_res, h_out, h_post):
    """EMULATOR of ``torch_npu.npu_mhc_post`` (doc: ``torch_npu-npu_mhc_post.md``).

    ``x_next = H_res × x + h_out ⊗ H_post``: ``x_next[n] = sum_j h_res[n, j] x[j] + h_post[n] h_out``
    (``h_res=None``: ``x[n] + h_post[n] h_out``).  ``x`` ``[T, n, D]`` bfloat16 / float16,
    ``h_out`` ``[T, D]`` of ``x``'s dtype, ``h_res`` float32 ``[T, n, n]``, ``h_post`` float32
    ``[T, n]``.  Silent in the doc, chosen here: ``H_res × x`` is the plain matrix product
    (output stream ``n`` takes row ``n`` of ``h_res``); computed in float32, rounded once.
    """
    _require(x.dtype in _FLOAT16S and h_out.dtype == x.dtype, "x / h_out: bfloat16 or float16, equal")
    _require(x.dim() == 3, "x must be [T, n, D] (the BSnD form is not emulated)")
    t, n, d = x.shape
    _require(tuple(h_out.shape) == (t, d) and tuple(h_post.shape) == (t, n), "h_out / h_post shapes")
    _require(h_post.dtype == torch.float32, "h_post must be float32")
    xf = x.float()
    if h_res is None:
        mixed = xf
    else:
        _require(
            tuple(h_res.shape) == (t, n, n) and h_res.dtype == torch.float32,
            "h_res must be float32 [T, n, n]",
        )
        mixed = torch.bmm(h_res.float(), xf)
    return (mixed + h_post.unsqueeze(-1) * h_out.float().unsqueeze(1)).to(x.dtype)


FUNCTIONS = {
    "npu_mhc_pre": npu_mhc_pre,
    "npu_mhc_sinkhorn": npu_mhc_sinkhorn,
    "npu_mhc_post": npu_mhc_post,
}
