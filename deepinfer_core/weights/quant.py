"""Quantised weight formats of DeepSeek-V4 checkpoints: dequantise at load, quantise for writing.

* **FP8 block** (non-expert linears): ``float8_e4m3fn`` data ``[..., out, in]`` with one scale
  per ``block[0] x block[1]`` tile (default 128x128), scale shape
  ``[..., ceil(out/b0), ceil(in/b1)]``; tiles at the right/bottom edges are partial.
  ``w = data * scale`` (the scale is what HF calls ``weight_scale_inv``).
* **FP4 e2m1** (routed experts): two 4-bit codes per byte, stored as ``uint8``/``int8``
  ``[..., out, in/2]``; the low nibble is the even element, the high nibble the odd one
  (as transformers' ``Fp8Dequantize._unpack_fp4``).  Code bits ``s e e m``: the sign is bit 3,
  magnitudes ``[0, .5, 1, 1.5, 2, 3, 4, 6]``.  One scale per ``group`` (32) inputs:
  scale shape ``[..., out, in/group]``.

Scales are ``float32`` or ``float8_e8m0fnu`` (ue8m0: a bare power of two).

By default the loader dequantises to the model dtype.  With the engine option
``keep_quantized`` (``load_checkpoint(..., keep_quantized=True)``) the two formats a backend can
run natively stay in their checkpoint form as :class:`QuantizedTensor` values: FP8 block-scaled
dense weights (:data:`FP8_BLOCK`) and FP4 routed experts (:data:`FP4_EXPERTS`).  The ops that take
weights (``linear``, ``grouped_linear``, ``moe_experts``) accept them; their references
dequantise per call with :meth:`QuantizedTensor.dequantize`, which gives bitwise the values the
loader would have produced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer_core.errors import WeightLoadError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
UE8M0_DTYPE = torch.float8_e8m0fnu
FP4_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
DEFAULT_FP8_BLOCK = (128, 128)
DEFAULT_FP4_GROUP = 32
FP4_STORAGE_DTYPES = (torch.uint8, torch.int8)
_FP4_X2 = getattr(torch, "float4_e2m1fn_x2", None)

FP8_BLOCK = "fp8_block"
"""Format name: FP8 e4m3 dense (non-expert) weights with 2-D block scales (128x128 in V4)."""
FP4_EXPERTS = "fp4_experts"
"""Format name: FP4 e2m1 routed-expert stacks with one scale per 32 inputs."""
QUANTIZED_FORMATS = (FP8_BLOCK, FP4_EXPERTS)
"""Every format the loader can keep quantised (``keep_quantized=True`` keeps them all)."""
DEQUANT_CHUNK_ELEMENTS = 1 << 24
"""Elements :meth:`QuantizedTensor.dequantize` dequantises at a time (bounds its float32
temporaries: a whole V4-Flash expert stack at once would need several times its size)."""


def _decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """The float32 values of 4-bit e2m1 codes (``s e e m``; sign bit 3).

    Computed elementwise (exponent 0: ``m / 2``; else ``2**(e-1) * (1 + m/2)``), exactly the
    values of :data:`E2M1_MAGNITUDES`, with no table built from host data: a weight dequantised
    per call inside a captured device graph must not copy from the host.
    """
    c = codes.to(torch.int32)
    exp = (c >> 1) & 3
    man = (c & 1).to(torch.float32)
    normal = torch.ldexp(1.0 + 0.5 * man, (exp - 1).clamp(min=0))
    mag = torch.where(exp == 0, 0.5 * man, normal)
    return torch.where((c & 8) != 0, -mag, mag)


@dataclass(eq=False)
class QuantizedTensor:
    """A weight kept in its checkpoint format: what the weight-taking ops receive with the engine
    option ``keep_quantized`` (see :func:`~deepinfer_core.weights.load_checkpoint`).

    ``fmt`` is ``"fp8"``: ``data`` ``float8_e4m3fn`` ``[..., out, in]``, ``block = (b_out, b_in)``
    (128x128 in V4) and ``scale`` ``[..., ceil(out/b_out), ceil(in/b_in)]`` (edge tiles partial);
    or ``"fp4"``: ``data`` packed e2m1 ``uint8`` ``[..., out, in/2]`` (low nibble = even element),
    ``block = (1, group)`` (group 32 in V4) and ``scale`` ``[..., out, in/group]``.  ``scale`` is
    float32 or ``float8_e8m0fnu``; the weight is ``data * scale``.  :attr:`shape` is the logical
    ``[..., out, in]`` shape.  Construction checks dtypes and shapes (int8 or
    ``float4_e2m1fn_x2`` FP4 storage is viewed as ``uint8``) and raises :class:`WeightLoadError`.
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    block: tuple[int, int]

    def __post_init__(self) -> None:
        self.block = (int(self.block[0]), int(self.block[1]))
        if self.block[0] < 1 or self.block[1] < 1:
            raise WeightLoadError(f"quantised weight: block {self.block} must be positive")
        if self.scale.dtype not in (torch.float32, UE8M0_DTYPE):
            raise WeightLoadError(f"quantised weight: scale dtype {self.scale.dtype} is not float32 or ue8m0")
        if self.data.dim() < 2:
            raise WeightLoadError(
                f"quantised weight: data has shape {tuple(self.data.shape)}, need [..., out, in]"
            )
        if self.fmt == "fp8":
            if self.data.dtype != FP8_DTYPE:
                raise WeightLoadError(f"FP8 weight: data dtype {self.data.dtype} is not float8_e4m3fn")
            rows, cols = self.data.shape[-2:]
            expected = (
                *self.data.shape[:-2],
                math.ceil(rows / self.block[0]),
                math.ceil(cols / self.block[1]),
            )
            _check_scale_shape(self.scale, expected, f"FP8 block {self.block}")
        elif self.fmt == "fp4":
            if self.data.dtype in FP4_STORAGE_DTYPES or (_FP4_X2 is not None and self.data.dtype == _FP4_X2):
                self.data = self.data.view(torch.uint8)
            else:
                raise WeightLoadError(f"FP4 weight: data dtype {self.data.dtype} is not packed uint8")
            group, cols = self.block[1], 2 * self.data.shape[-1]
            if self.block[0] != 1 or cols % group:
                raise WeightLoadError(
                    f"FP4 weight with {cols} inputs and block {self.block}: needs block (1, group) "
                    "with the inputs a multiple of the group"
                )
            _check_scale_shape(self.scale, (*self.data.shape[:-1], cols // group), f"FP4 group {group}")
        else:
            raise WeightLoadError(f"quantised weight: unknown format {self.fmt!r} (expected 'fp8' or 'fp4')")

    @property
    def shape(self) -> torch.Size:
        """The logical (dequantised) shape ``[..., out, in]``."""
        if self.fmt == "fp4":
            return torch.Size((*self.data.shape[:-1], 2 * self.data.shape[-1]))
        return self.data.shape

    @property
    def device(self) -> torch.device:
        """The device of the data and scales."""
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held: the data plus the scales."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full-precision weight in ``dtype`` (computed in float32, then cast: bitwise what
        ``load_checkpoint`` returns for this tensor without ``keep_quantized``).

        A large weight is dequantised in slices of its leading dim (whole blocks of rows for a
        2-D FP8 weight) into the output, so the float32 intermediates stay near
        :data:`DEQUANT_CHUNK_ELEMENTS` elements; the slices depend on shapes only (no host sync).
        """
        lead = self.data.shape[0]
        step = max(1, DEQUANT_CHUNK_ELEMENTS // max(1, self.shape[1:].numel()))
        if self.fmt == "fp8" and self.data.dim() == 2:
            step = -(-step // self.block[0]) * self.block[0]  # whole scale rows per slice
        if step >= lead:
            return self._dequantize(dtype)
        out = torch.empty(self.shape, dtype=dtype, device=self.device)
        for start in range(0, lead, step):
            out[start : start + step] = self._rows(start, start + step)._dequantize(dtype)
        return out

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt == "fp8":
            return dequant_fp8(self.data, self.scale, self.block, dtype)
        return dequant_fp4(self.data, self.scale, self.block[1], dtype)

    def _rows(self, start: int, end: int) -> QuantizedTensor:
        """Items ``start:end`` of the leading dim (rows of a 2-D FP8 weight: ``start`` a multiple
        of the block rows)."""
        if self.fmt == "fp8" and self.data.dim() == 2:
            b = self.block[0]
            scale = self.scale[start // b : -(-min(end, self.data.shape[0]) // b)]
        else:
            scale = self.scale[start:end]
        return QuantizedTensor(self.data[start:end], scale, self.fmt, self.block)

    def to(self, device: torch.device | str) -> QuantizedTensor:
        """This weight with data and scales on ``device``."""
        return QuantizedTensor(self.data.to(device), self.scale.to(device), self.fmt, self.block)

    def index_select(self, index: torch.Tensor) -> QuantizedTensor:
        """The items ``index`` of the leading dim (e.g. some experts of a ``[E, out, in]`` stack).

        Gathers the bytes, so it works for every data and scale dtype on every device; no host sync.
        """
        return QuantizedTensor(_take(self.data, index), _take(self.scale, index), self.fmt, self.block)


Weight = torch.Tensor | QuantizedTensor
"""A model weight as loaded: a tensor, or a :class:`QuantizedTensor` with ``keep_quantized``."""


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, index)``, through a ``uint8`` view for 1-byte dtypes (fp8, e8m0)."""
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8).index_select(0, index).view(t.dtype)
    return t.index_select(0, index)


def concat_problem(parts: list[QuantizedTensor]) -> str | None:
    """Why ``parts`` cannot be concatenated along the output dim (``None`` if they can).

    They need one format, block, scale dtype and input width, and every part but the last an
    output dim that is a multiple of the block rows (so that no scale tile spans two parts).
    """
    first = parts[0]
    for p in parts[1:]:
        if (p.fmt, p.block, p.scale.dtype) != (first.fmt, first.block, first.scale.dtype):
            return (
                f"formats differ ({first.fmt} {first.block} {first.scale.dtype} vs "
                f"{p.fmt} {p.block} {p.scale.dtype})"
            )
        if p.shape[:-2] != first.shape[:-2] or p.shape[-1] != first.shape[-1]:
            return f"input shapes differ ({tuple(first.shape)} vs {tuple(p.shape)})"
    rows = first.block[0]
    if any(p.shape[-2] % rows for p in parts[:-1]):
        outs = ", ".join(str(p.shape[-2]) for p in parts)
        return f"output dims {outs} are not multiples of the {first.fmt.upper()} block rows {rows}"
    return None


def concat_quantized(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """``parts`` stacked along the output dim (data and scales), as one weight whose matmul gives
    the parts' outputs side by side.  Raises ``ValueError`` with :func:`concat_problem`'s reason."""
    problem = concat_problem(parts)
    if problem is not None:
        raise ValueError(f"cannot concatenate quantised weights: {problem}")
    data = torch.cat([_as_bytes(p.data) for p in parts], dim=-2).view(parts[0].data.dtype)
    scale = torch.cat([_as_bytes(p.scale) for p in parts], dim=-2).view(parts[0].scale.dtype)
    return QuantizedTensor(data, scale, parts[0].fmt, parts[0].block)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _expand_scale(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Repeat a per-tile scale over its tile and crop the partial edge tiles to ``shape``."""
    s = scale.float()
    s = s.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return s[..., : shape[-2], : shape[-1]]


def _check_scale_shape(scale: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(scale.shape) != expected:
        raise WeightLoadError(f"{what}: scale has shape {tuple(scale.shape)}, expected {expected}")


def dequant_fp8(
    data: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = DEFAULT_FP8_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantise block-scaled FP8 e4m3 ``data`` ``[..., out, in]`` to ``dtype``.

    ``scale`` is ``[..., ceil(out/block[0]), ceil(in/block[1])]`` (float32 or ue8m0).
    """
    rows, cols = data.shape[-2:]
    expected = (*data.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    _check_scale_shape(scale, expected, f"FP8 block {block}")
    return (data.float() * _expand_scale(scale, block, data.shape)).to(dtype)


def _scale_from_amax(amax: torch.Tensor, qmax: float, scale_dtype: str) -> torch.Tensor:
    """Per-block scale mapping ``amax`` onto the format's largest value (zeros -> scale 1)."""
    s = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    if scale_dtype == "ue8m0":
        # Round up to a power of two so that amax / s still fits the format's range.
        s = torch.exp2(torch.ceil(torch.log2(s)))
        return s.to(UE8M0_DTYPE)
    if scale_dtype != "fp32":
        raise ValueError(f"scale_dtype must be 'fp32' or 'ue8m0', got {scale_dtype!r}")
    return s.float()


def quant_fp8(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_FP8_BLOCK, scale_dtype: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w`` ``[..., out, in]`` to FP8 e4m3 with per-block scales; returns ``(data, scale)``.

    Each element's error is at most ``2**-4 * |w| + 2**-10 * s`` where ``s`` is its block's scale
    (``amax / 448``, or the next power of two for ue8m0): e4m3 keeps 3 mantissa bits (half-ulp
    relative error ``2**-4``) down to its smallest normal ``2**-6``, below which the absolute
    step is ``2**-9`` (half: ``2**-10``) in scaled units.
    """
    rows, cols = w.shape[-2:]
    br, bc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    x = w.float()
    padded = torch.nn.functional.pad(x.abs(), (0, bc * block[1] - cols, 0, br * block[0] - rows))
    tiles = padded.reshape(*w.shape[:-2], br, block[0], bc, block[1])
    scale = _scale_from_amax(tiles.amax(dim=(-3, -1)), FP8_MAX, scale_dtype)
    q = (x / _expand_scale(scale, block, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack e2m1 codes (two per byte, low nibble first) to float32 ``[..., 2 * n]``."""
    u8 = packed.contiguous().view(torch.uint8)
    codes = torch.stack([u8 & 0xF, u8 >> 4], dim=-1).reshape(*u8.shape[:-1], 2 * u8.shape[-1])
    return _decode_e2m1(codes)


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Round each value to the nearest e2m1 number; returns its 4-bit code as ``uint8``.

    Values beyond ±6 saturate; ties go to the smaller magnitude.
    """
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=values.device)
    v = values.float()
    idx = (v.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)
    sign = torch.signbit(v).to(torch.uint8) << 3
    return idx.to(torch.uint8) | sign


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[..., 2 * n]`` into bytes ``[..., n]`` (even element in the low nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def dequant_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    group: int = DEFAULT_FP4_GROUP,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantise packed e2m1 ``[..., out, in/2]`` with per-``group`` scales ``[..., out, in/group]``."""
    values = unpack_fp4(packed)
    cols = values.shape[-1]
    if cols % group:
        raise WeightLoadError(f"FP4 weight with {cols} inputs is not a multiple of the scale group {group}")
    _check_scale_shape(scale, (*values.shape[:-1], cols // group), f"FP4 group {group}")
    return (values * scale.float().repeat_interleave(group, dim=-1)).to(dtype)


def quant_fp4(
    w: torch.Tensor, group: int = DEFAULT_FP4_GROUP, scale_dtype: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w`` ``[..., out, in]`` to packed e2m1 with per-``group`` scales -> ``(packed, scale)``.

    Each element's error is at most ``max(|w| / 4, s / 4)`` for its group scale ``s``: the gap
    between neighbouring e2m1 magnitudes is at most a quarter of the larger one above 1 and
    0.5 below it.
    """
    cols = w.shape[-1]
    if cols % group:
        raise ValueError(f"FP4 quantisation needs inputs ({cols}) to be a multiple of the group ({group})")
    x = w.float()
    grouped = x.reshape(*w.shape[:-1], cols // group, group)
    scale = _scale_from_amax(grouped.abs().amax(dim=-1), FP4_MAX, scale_dtype)
    codes = encode_e2m1(x / scale.float().repeat_interleave(group, dim=-1))
    return pack_fp4(codes), scale
