"""DeepSeek's TileKernels (``tile_kernels``) as a second source of kernels for some ops.

TileKernels is a library of TileLang kernels (MIT licence).  For the ops where it has a kernel
with our contract's semantics, an *adapter* here calls it with exactly the op's signature and
result (layouts, dtypes, argument conversions; where TileKernels splits the op into several
kernels, they are composed), and says which calls it takes (``supports``: shapes and dtypes
only, never values).  One module per op family:

- :mod:`.mhc`: ``hc_pre`` (the prenorm GEMM in PyTorch, then ``mhc_pre_big_fuse_fwd``),
  ``hc_post`` (``mhc_post_fwd``), V4.1's ``deepseek_v41.hc_collapse`` (``mhc_pre_apply_mix_fwd``);
- :mod:`.rope`: ``apply_rope`` (``apply_rotary``, interleaved);
- :mod:`.routing`: ``moe_route`` with ``sqrtsoftplus`` scoring, top-k and hash routing
  (``moe_topk_gate_forward``);
- :mod:`.quant`: V4.1's ``deepseek_v41.kv_qdq`` for the UE8M0 formats
  (``per_token_cast_and_cast_back``);
- :mod:`.engram`: V4.1's ``deepseek_v41.engram_hash`` (``engram_hash``) and
  ``deepseek_v41.engram_mix`` (``engram_gate_fwd``).

Which source serves a call is decided by :mod:`deepinfer_cuda_sm100.tk_dispatch` from the
measured table (:mod:`deepinfer_cuda_sm100.kernel_choice`).  TileKernels is an optional extra
(:data:`INSTALL_HINT`); without it every op keeps its own kernel (:func:`tilekernels_problem`
says why, logged once).  Importing this package imports neither TileKernels nor TileLang.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

INSTALL_HINT = (
    "pip install -e 'plugins/cuda_sm100[tilekernels]' (from the root of a DeepInfer checkout; where torch "
    "is older than TileKernels' pin, pip install --no-deps 'tile-kernels>=2.1')"
)

LANGUAGE = "tilekernels"
"""The language name of TileKernels' points in the measured table."""

Verdict = bool | str


@functools.cache
def tilekernels_problem() -> str | None:
    """``None`` when TileKernels' kernels can be compiled and run here, else why not (one line)."""
    if importlib.util.find_spec("tile_kernels") is None:
        return f"TileKernels is not installed: {INSTALL_HINT}"
    from deepinfer_cuda_sm100 import tl

    problem = tl.tilelang_problem()
    if problem is not None:
        return f"TileKernels runs on TileLang: {problem}"
    try:
        import tile_kernels  # noqa: F401
    except Exception as exc:  # an incompatible TileLang or torch: one line, not a traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"TileKernels does not import ({type(exc).__name__}: {first})"
    return None


class ChoiceKey(NamedTuple):
    """Where a call sits in the measured table (:class:`~deepinfer_cuda_sm100.kernel_choice.Point`'s
    fields): ``kind`` a variant of the op, ``heads`` / ``head_dim`` its two widths, ``tokens`` the
    rows, ``keys`` a third size (0 where the op has none)."""

    kind: str
    dtype: str
    heads: int
    head_dim: int
    tokens: int
    keys: int = 0


@dataclass(frozen=True)
class Adapter:
    """TileKernels serving one op.

    Attributes:
        op: the op's name in the contract.
        run: callable with exactly the op's signature and results.
        supports: the op's arguments -> ``True`` or why TileKernels cannot take the call.
        key: the op's arguments -> its :class:`ChoiceKey` (static shapes only).
        kernels: the TileKernels functions ``run`` calls (in order).
        row_independent: each output row depends only on its own input row (no split over tokens
            that depends on the batch), checked bitwise by the GPU tests and the benchmark.
    """

    op: str
    run: Callable[..., Any]
    supports: Callable[..., Verdict]
    key: Callable[..., ChoiceKey]
    kernels: tuple[str, ...]
    row_independent: bool


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def first_problem(*checks: tuple[bool, str]) -> Verdict:
    """``True`` if every ``(ok, reason)`` holds, else the first failing reason."""
    for ok, reason in checks:
        if not ok:
            return reason
    return True


def device_last(shapes: Callable[..., Verdict]) -> Callable[..., Verdict]:
    """A ``supports`` predicate: ``shapes``'s verdict (shapes and dtypes), then every tensor
    argument on one CUDA device (:func:`on_cuda`)."""
    signature = inspect.signature(shapes)

    @functools.wraps(shapes)
    def supports(*args, **kwargs) -> Verdict:
        ok = shapes(*args, **kwargs)
        if ok is not True:
            return ok
        bound = signature.bind(*args, **kwargs).arguments
        return on_cuda(**{name: v for name, v in bound.items() if isinstance(v, torch.Tensor)})

    return supports


def on_cuda(**tensors) -> Verdict:
    """Every given tensor is a CUDA tensor of one device."""
    devices = {t.device for t in tensors.values()}
    for name, t in tensors.items():
        if t.device.type != "cuda":
            return f"{name} is on {t.device}: TileKernels runs on CUDA tensors"
    return True if len(devices) <= 1 else f"the tensors are on several devices ({sorted(map(str, devices))})"


def adapters() -> dict[str, Adapter]:
    """Every adapter, by op name (imports the adapter modules, not TileKernels)."""
    from deepinfer_cuda_sm100.tk import engram, mhc, quant, rope, routing

    found = [*mhc.ADAPTERS, *rope.ADAPTERS, *routing.ADAPTERS, *quant.ADAPTERS, *engram.ADAPTERS]
    return {a.op: a for a in found}
