"""EMULATOR of the row-wise ``torch_npu`` operators the attention side calls: ``npu_rms_norm``,
``npu_rotary_mul`` and ``npu_scatter_nd_update_``.  Tests only.

Sources (Ascend/op-plugin, branch master as mirrored, ``docs/zh/custom_APIs/torch_npu/``):
``（beta）torch_npu-npu_rms_norm.md``, ``torch_npu-npu_rotary_mul.md``,
``torch_npu-npu_scatter_nd_update_.md``.  None of them says in which precision the operator
computes; the emulator computes in float32 and rounds once to the output dtype, and says so
at each function.
"""

from __future__ import annotations

import torch

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"EMULATOR torch_npu: {message}")


def npu_rms_norm(self, gamma, epsilon=1e-6):
    """EMULATOR of ``torch_npu.npu_rms_norm`` (doc: ``（beta）torch_npu-npu_rms_norm.md``).

    ``RmsNorm(x)_i = x_i / sqrt(mean(x²) + eps) * g_i`` over the trailing ``gamma.dim()``
    dimensions; returns ``(y, rstd)`` with ``y`` in ``self``'s dtype and ``rstd`` float32 of the
    leading shape.  The (self, gamma) dtype pairs of the A2/A3 table are accepted (the doc gives
    no 950 table).  Silent in the doc, chosen here: computed in float32 (gamma applied in
    float32), rounded once.
    """
    _require(self.dtype in _FLOATS, f"self dtype {self.dtype} is not float32/bfloat16/float16")
    _require(gamma.dtype in (self.dtype, torch.float32), f"gamma dtype {gamma.dtype} for self {self.dtype}")
    _require(self.dtype != torch.float32 or gamma.dtype == torch.float32, "float32 self needs float32 gamma")
    _require(2 <= self.dim() <= 8, "self must have 2..8 dims")
    k = gamma.dim()
    _require(tuple(self.shape[-k:]) == tuple(gamma.shape), "gamma must match self's trailing shape")
    x = self.float()
    dims = tuple(range(-k, 0))
    rstd = torch.rsqrt(x.square().mean(dim=dims, keepdim=True) + epsilon)
    y = x * rstd * gamma.float()
    return y.to(self.dtype), rstd.reshape(self.shape[:-k])


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):  # noqa: A002 (the documented name)
    """EMULATOR of ``torch_npu.npu_rotary_mul`` (doc: ``torch_npu-npu_rotary_mul.md``).

    ``output = x * cos + rotate(x) * sin`` with ``cos = r1``, ``sin = r2`` broadcast against
    ``x``; ``rotary_mode="interleave"``: ``rotate(x)`` maps each pair ``(x[2i], x[2i+1])`` to
    ``(-x[2i+1], x[2i])``; ``"half"``: ``concat(-x2, x1)`` of the two halves.  Inputs of 3 or 4
    dims.  For interleave mode and a TND input the doc lists ``r1`` / ``r2`` of layout ``T1D``.
    Silent in the doc, chosen here: computed in float32, rounded once to ``input``'s dtype.  The
    doc's data range of ``r1`` / ``r2`` ([-1, 1]) is not checked (a value check), and ``rotate``
    (a rotation matrix) is not emulated.
    """
    _require(rotate is None, "rotate is not emulated")
    _require(rotary_mode in ("half", "interleave"), f"rotary_mode {rotary_mode!r} is not half or interleave")
    _require(
        input.dim() in (3, 4) and r1.dim() in (3, 4) and r2.dim() in (3, 4), "inputs must have 3 or 4 dims"
    )
    _require(input.dtype in _FLOATS, f"input dtype {input.dtype}")
    _require(input.shape[-1] % 2 == 0 and input.shape[-1] < 896, "D must be even and < 896")
    x = input.float()
    if rotary_mode == "interleave":
        pairs = x.unflatten(-1, (-1, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    return (x * r1.float() + rotated * r2.float()).to(input.dtype)


def npu_scatter_nd_update_(input, indices, updates):  # noqa: A002 (the documented name)
    """EMULATOR of ``torch_npu.npu_scatter_nd_update_`` (doc: ``torch_npu-npu_scatter_nd_update_.md``).

    In place: ``input[tuple(indices[m])] = updates[m]``, ``indices`` int32 / int64 with at
    least 2 dims whose last dim ``a`` indexes ``input``'s first ``a`` dims; ``updates`` has
    ``indices.shape[:-1] + input.shape[a:]`` and ``input``'s dtype.  Returns ``input``.
    Silent in the doc, chosen here: with repeated indices one of the updates survives
    (unspecified which); an out-of-range index raises (the doc: not supported).
    """
    _require(indices.dtype in (torch.int32, torch.int64), f"indices dtype {indices.dtype}")
    _require(indices.dim() >= 2, "indices needs at least 2 dims")
    _require(updates.dtype == input.dtype, f"updates dtype {updates.dtype} differs from input {input.dtype}")
    a = indices.shape[-1]
    _require(a <= input.dim(), "indices' last dim exceeds input's dims")
    want = (*indices.shape[:-1], *input.shape[a:])
    _require(tuple(updates.shape) == want, f"updates shape {tuple(updates.shape)}, expected {want}")
    flat = indices.reshape(-1, a).long()
    for dim in range(a):
        bad = (flat[:, dim] < 0) | (flat[:, dim] >= input.shape[dim])
        _require(not bool(bad.any()), "an index is out of range")
    input[tuple(flat.t())] = updates.reshape(-1, *input.shape[a:])
    return input


FUNCTIONS = {
    "npu_rms_norm": npu_rms_norm,
    "npu_rotary_mul": npu_rotary_mul,
    "npu_scatter_nd_update_": npu_scatter_nd_update_,
}
