"""Argument checks shared by the ``supports`` predicates of every op module (no Triton import)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Activation dtypes the kernels take."""

MAX_NORM_TILE = 4096
"""Widest row a kernel that fuses ``rms_norm`` takes (``hc_post_pre``, ``qk_norm_rope``): it
norms a row in one tile, as the norm kernel does up to its ``MAX_BLOCK_D`` (restated here so
that importing this module does not import Triton)."""


def device_problem(interpreted: bool, named: Iterable[tuple[str, object]]) -> str | None:
    """Why the named arguments are not tensors on one device of the kind the kernels run on
    (CPU under ``TRITON_INTERPRET=1``, else the current CUDA device), or ``None``."""
    want = "cpu" if interpreted else "cuda"
    devices = set()
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            return f"{name} is a {type(t).__name__}, not a tensor"
        if t.device.type != want:
            how = "Triton's CPU interpreter (TRITON_INTERPRET=1)" if interpreted else "the GPU"
            return f"{name} is on {t.device}: the kernels run in {how} on {want} tensors"
        devices.add(t.device)
    if len(devices) > 1:
        return f"inputs are on several devices: {sorted(map(str, devices))}"
    if devices and not interpreted:  # Triton launches on the current device
        (device,) = devices
        current = torch.cuda.current_device()
        if device.index is not None and device.index != current:
            return f"inputs are on {device} but the current CUDA device is cuda:{current}"
    return None


def is_int_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` holds integers (not floating point, complex or bool)."""
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def first_problem(*checks: tuple[bool, str]) -> bool | str:
    """``True`` if every ``(ok, reason)`` holds, else the first failing reason."""
    for ok, reason in checks:
        if not ok:
            return reason
    return True


def int_vector(name: str, t: torch.Tensor, n: int) -> bool | str:
    """``True`` if ``t`` is an ``[n]`` integer tensor, else the reason naming it."""
    return first_problem(
        (is_int_tensor(t), f"{name} dtype {t.dtype} is not an integer dtype"),
        (tuple(t.shape) == (n,), f"{name} has shape {tuple(t.shape)}, expected {(n,)}"),
    )


Verdict = bool | str


def device_checks(interpreted: bool, **tensors: torch.Tensor | None) -> Verdict:
    """The given (non-``None``) tensors are on one device of the kind the kernels run on."""
    present = [(name, t) for name, t in tensors.items() if t is not None]
    return device_problem(interpreted, present) or True


def activation(name: str, t: torch.Tensor) -> tuple[bool, str]:
    """``t`` is an fp32 / bf16 / fp16 activation."""
    return t.dtype in FLOAT_DTYPES, f"{name} dtype {t.dtype} is not one of float32, bfloat16, float16"


def float_dtype(name: str, t: torch.Tensor) -> tuple[bool, str]:
    """``t`` has a floating-point dtype."""
    return t.is_floating_point(), f"{name} dtype {t.dtype} is not a floating-point dtype"


def number(name: str, x) -> tuple[bool, str]:
    """``x`` is a Python int or float (not a bool)."""
    ok = isinstance(x, int | float) and not isinstance(x, bool)
    return ok, f"{name} is a {type(x).__name__}, not a number"


def shape_is(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> tuple[bool, str]:
    """``t`` has exactly ``shape``."""
    return tuple(t.shape) == shape, f"{name} has shape {tuple(t.shape)}, expected {shape}"


def fused_norm(d: int, name: str, weight) -> list[tuple[bool, str]]:
    """The checks of an ``rms_norm`` that a fused kernel applies to rows of ``d`` channels held in
    one tile (at most :data:`MAX_NORM_TILE`), with the weight ``name`` (``[d]`` float, or ``None``)."""
    fits = (
        d <= MAX_NORM_TILE,
        f"D={d} is over {MAX_NORM_TILE}: the fused kernel norms a row in one tile "
        "(the ops it fuses run apart)",
    )
    return [fits] if weight is None else [fits, float_dtype(name, weight), shape_is(name, weight, (d,))]
