"""The ``cpu`` backend's op implementations: thin wrappers over the C++ kernels
(``csrc/kernels.cpp``) with the reference signatures, and their ``supports`` predicates.

The kernels take float32 CPU tensors; any other dtype or device is refused with the reason,
so the engine runs that call on the reference."""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer_core.ops import OpImpl, all_ops
from deepinfer_core.ops.registry import is_extension

F32 = torch.float32
PROVIDED_OPS = ("rms_norm", "hc_pre", "hc_post", "hc_head")


def _refusal(tensors: dict[str, torch.Tensor | None]) -> bool | str:
    """``True`` when every given tensor is float32 on the CPU, else the reason naming one."""
    for name, t in tensors.items():
        if t is not None and (t.dtype != F32 or t.device.type != "cpu"):
            return f"{name} is {t.dtype} on {t.device.type}: the cpu kernels take float32 CPU tensors"
    return True


def make_ops(ext: ModuleType) -> dict[str, OpImpl]:
    """The op table entries over the loaded extension module ``ext``."""

    def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return ext.rms_norm(x, weight, eps)

    def rms_norm_supports(x, weight, eps):
        return _refusal({"x": x, "weight": weight})

    def hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
        return ext.hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)

    def hc_pre_supports(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
        if sinkhorn_iters < 1:
            return f"sinkhorn_iters={sinkhorn_iters}: the kernel runs at least one normalisation"
        return _refusal({"streams": streams, "fn": fn, "base": base, "scale": scale})

    def hc_post(block_out, streams, post, comb):
        return ext.hc_post(block_out, streams, post, comb)

    def hc_post_supports(block_out, streams, post, comb):
        return _refusal({"block_out": block_out, "streams": streams, "post": post, "comb": comb})

    def hc_head(streams, fn, base, scale, norm_eps, hc_eps):
        return ext.hc_head(streams, fn, base, scale, norm_eps, hc_eps)

    def hc_head_supports(streams, fn, base, scale, norm_eps, hc_eps):
        return _refusal({"streams": streams, "fn": fn, "base": base, "scale": scale})

    # The other core ops: the reference is this backend's implementation (plain PyTorch is
    # already fast for them on CPU: GEMMs, gathers), listed so that the engine does not warn
    # about ops the backend leaves out.
    delegated = {
        name: OpImpl(fn=spec.reference)
        for name, spec in all_ops().items()
        if name not in PROVIDED_OPS and not is_extension(name)
    }
    return delegated | {
        "rms_norm": OpImpl(fn=rms_norm, supports=rms_norm_supports),
        "hc_pre": OpImpl(fn=hc_pre, supports=hc_pre_supports),
        "hc_post": OpImpl(fn=hc_post, supports=hc_post_supports),
        "hc_head": OpImpl(fn=hc_head, supports=hc_head_supports),
    }
