"""Ops served by DeepSeek's TileKernels where they were measured faster, else by our own kernel.

:func:`make_dispatcher` wraps an op's own implementation (our Triton kernel, or for V4.1's ops
that have no kernel of ours the core's reference) and a TileKernels adapter
(:mod:`deepinfer_cuda_sm100.tk`).  A call goes to TileKernels when all of these hold:

- the engine is not in batch-invariant mode.  The choice follows the token count, so a row
  could be computed by one source alone and by the other inside a larger batch, and two
  sources do not round alike: the mode keeps the op's own kernel for every call (whether each
  TileKernels kernel is row independent is checked by the GPU tests and the benchmark, but that
  does not make the two sources agree);
- TileKernels can run here (:func:`~deepinfer_cuda_sm100.tk.tilekernels_problem`; if not, one
  warning per op says why and the op's own kernel serves every call), and the call's tensors
  are on a CUDA device;
- the adapter takes the call (its ``supports``: shapes and dtypes only);
- the measured table of this GPU's architecture picks TileKernels at the nearest measured
  point of the call's key (:mod:`deepinfer_cuda_sm100.kernel_choice`).

The choice depends on static shapes, dtypes and the mode only (memoised per key), so a
captured CUDA graph replays the kernel it captured; nothing is timed inside a request.
:func:`tilekernels_ops` is what the backend's ``load_ops`` adds: dispatchers for the ops that
the shipped table of this GPU shows TileKernels winning at some point, and only where
TileKernels can run.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from deepinfer_core.ops import OpImpl
from deepinfer_core.ops.modes import batch_invariant_enabled
from deepinfer_cuda_sm100 import kernel_choice, tk

logger = logging.getLogger("deepinfer.cuda_sm100")

OWN_LANGUAGE = {
    "hc_pre": "triton",
    "hc_post": "triton",
    "apply_rope": "triton",
    "moe_route": "triton",
    "deepseek_v41.hc_collapse": "reference",
    "deepseek_v41.kv_qdq": "reference",
    "deepseek_v41.engram_hash": "reference",
    "deepseek_v41.engram_mix": "reference",
}
"""Each adapted op's own implementation: our Triton kernel, or the core's reference where this
backend has no kernel for the op (V4.1's extension ops)."""


@functools.cache
def _warn_unavailable(op: str, problem: str) -> None:
    logger.warning("%s: %s; our own implementation serves every call", op, problem)


def _choose_at(op: str, key: tk.ChoiceKey, arch: str, own: str) -> str:
    return kernel_choice.choose(
        op,
        key.kind,
        key.dtype,
        key.heads,
        key.head_dim,
        key.tokens,
        key.keys,
        arch,
        frozenset({own, tk.LANGUAGE}),
        default=own,
    )


def _first_device(args) -> torch.device | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def choose_language(op: str, adapter: tk.Adapter, args: tuple, kwargs: dict | None = None) -> str:
    """``"tilekernels"`` or the op's own language (:data:`OWN_LANGUAGE`) for this call."""
    own = OWN_LANGUAGE[op]
    if batch_invariant_enabled():
        return own
    problem = tk.tilekernels_problem()
    if problem is not None:
        _warn_unavailable(op, problem)
        return own
    device = _first_device(args)
    if device is None or device.type != "cuda":
        return own
    kwargs = kwargs or {}
    if adapter.supports(*args, **kwargs) is not True:
        return own
    return _choose_at(op, adapter.key(*args, **kwargs), kernel_choice.device_arch(device), own)


def make_dispatcher(op: str, own_fn: Callable, adapter: tk.Adapter) -> Callable:
    """The op: ``adapter.run`` where :func:`choose_language` picks TileKernels, else ``own_fn``."""

    def dispatch(*args, **kwargs):
        if choose_language(op, adapter, args, kwargs) == tk.LANGUAGE:
            return adapter.run(*args, **kwargs)
        return own_fn(*args, **kwargs)

    dispatch.__name__ = op.rsplit(".", 1)[-1]
    dispatch.__doc__ = f"``{op}``: TileKernels ({', '.join(adapter.kernels)}) or our own.\n\n{__doc__}"
    return dispatch


def measured_wins(arch: str, points: tuple[kernel_choice.Point, ...] | None = None) -> frozenset[str]:
    """The ops that TileKernels was measured faster than their own implementation at some point
    of the table of ``arch`` (``points`` replaces the shipped table: tests)."""
    found = kernel_choice.load_points(arch) if points is None else points
    return frozenset(
        p.op
        for p in found
        if p.op in OWN_LANGUAGE
        and tk.LANGUAGE in p.ms
        and OWN_LANGUAGE[p.op] in p.ms
        and p.ms[tk.LANGUAGE] < p.ms[OWN_LANGUAGE[p.op]]
    )


@functools.cache
def _log_absent(problem: str) -> None:
    logger.info("TileKernels: %s; our own kernels serve every op", problem)


def tilekernels_ops(own: dict[str, OpImpl], arch: str) -> dict[str, OpImpl]:
    """Dispatchers for the ops of :func:`measured_wins` (``own``: the backend's ops so far; an op
    it lacks is served by the core's reference), or ``{}`` where TileKernels cannot run here
    (logged once)."""
    problem = tk.tilekernels_problem()
    if problem is not None:
        _log_absent(problem)
        return {}
    wins = measured_wins(arch)
    if any(op.startswith("deepseek_v41.") for op in wins):
        from deepinfer_core.models.deepseek_v41 import ops as _v41  # noqa: F401  (defines the ops)
    from deepinfer_core.ops.registry import get_op

    out: dict[str, OpImpl] = {}
    for op, adapter in tk.adapters().items():
        if op not in wins:
            continue
        base = own.get(op)
        if base is None:
            out[op] = OpImpl(fn=make_dispatcher(op, get_op(op).reference, adapter))
        else:
            out[op] = OpImpl(
                fn=make_dispatcher(op, base.fn, adapter),
                supports=base.supports,
                sample_cases=base.sample_cases,
            )
    return out
