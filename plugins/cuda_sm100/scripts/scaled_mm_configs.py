"""torch's block-scaled FP8 GEMM (``scaled_mm``) as ``bench_fp8_gemm.py`` times it: the ways to
call it on DeepSeek-style scales, and the first that runs and agrees with a bf16 matmul."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def scaled_mm_configs(x: torch.Tensor, w) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """``(label, call)``: the ways to run ``x @ w.T`` as a DeepSeek-style block-scaled FP8 GEMM
    in torch (1x128 activation scales, 128x128 weight scales), the documented one first.

    What PyTorch's CUDA source requires (aten/src/ATen/native/cuda/ScaledBlas.cpp; Blas.cpp
    before the split), on Hopper (SM90) only, with cuBLASLt >= 12.9:

    * ``mat_a`` [M, K] float8_e4m3fn row-major, ``mat_b`` [K, N] float8_e4m3fn column-major
      (``_scaled_gemm``: "Only multiplication of row-major and column-major matrices");
    * ``scale_a`` float32 [M, ceil(K/128)], outer-dim-major: strides ``(1, M)``
      (``is_blockwise_1x128_scaling`` / ``_scaled_block1x128_block128x128``);
    * ``scale_b`` float32, the [ceil(N/128), ceil(K/128)] weight scales transposed, each row
      padded to a multiple of 4 floats (16 bytes): ``torch._scaled_mm`` checks ``scale_b.t()``
      for shape [ceil(N/128), ceil(K/128)], strides ``(round_up(ceil(K/128), 4), 1)`` (2.9's
      ``is_blockwise_128x128_scaling``; later versions want the unpadded row length, the same
      number whenever ceil(K/128) is a multiple of 4, as in every shape here), while
      ``torch.nn.functional.scaled_mm`` (``_scaled_mm_v2``, with explicit
      ``ScalingType.BlockWise1x128`` / ``BlockWise128x128`` recipes) wants the padded shape
      [round_up(ceil(K/128), 4), ceil(N/128)] with strides ``(1, round_up(ceil(K/128), 4))``.

    ``x.t().contiguous().t()`` does not give strides ``(1, M)`` when M is 1 (``contiguous`` keeps
    the view), which ``_scaled_mm_v2`` rejects: the scales are copied into a [K/128, M] buffer.
    Each with M padded to a multiple of 16 as well (zero rows; the output sliced back), in case
    cuBLASLt wants aligned scale rows; then the layouts the script tried before, as fallbacks.
    """
    from deepinfer_cuda_sm100.kernels.fp8_gemm import quantize_activations
    from deepinfer_cuda_sm100.scaled_mm import activation_scales, weight_scales

    xq, xs = quantize_activations(x)  # [M, K] e4m3, [M, K/128] fp32 (x = xq * scale)
    m, k = xq.shape
    kb = k // 128
    b = w.data.t()  # [K, N], column-major
    ws = w.scale.float()  # [N/128, K/128]

    sb_v2 = weight_scales(w.scale)  # [kb4, N/128], strides (1, kb4)
    sb_v1 = sb_v2[:kb]  # [K/128, N/128], strides (1, kb4)
    sa = activation_scales(xs)
    m16 = _round_up(m, 16)
    xq16 = torch.zeros(m16, k, device=x.device, dtype=xq.dtype)
    xq16[:m] = xq
    xs16 = torch.ones(m16, kb, device=x.device)
    xs16[:m] = xs
    sa16 = activation_scales(xs16)

    functional = torch.nn.functional
    configs: list[tuple[str, Callable[[], torch.Tensor]]] = []
    if hasattr(functional, "scaled_mm") and hasattr(functional, "ScalingType"):
        recipes = functional.ScalingType.BlockWise1x128, functional.ScalingType.BlockWise128x128

        def v2(a: torch.Tensor, s_a: torch.Tensor) -> torch.Tensor:
            return functional.scaled_mm(
                a, b, s_a, recipes[0], sb_v2, recipes[1], output_dtype=torch.bfloat16
            )[:m]

        configs.append(("F.scaled_mm BlockWise1x128 x BlockWise128x128", lambda: v2(xq, sa)))
        if m16 != m:
            configs.append(("F.scaled_mm, M padded to 16", lambda: v2(xq16, sa16)))
    if hasattr(torch, "_scaled_mm"):

        def v1(a: torch.Tensor, s_a: torch.Tensor, s_b: torch.Tensor) -> torch.Tensor:
            return torch._scaled_mm(a, b, scale_a=s_a, scale_b=s_b, out_dtype=torch.bfloat16)[:m]

        configs.append(("torch._scaled_mm 1x128 x 128x128", lambda: v1(xq, sa, sb_v1)))
        if m16 != m:
            configs.append(("torch._scaled_mm, M padded to 16", lambda: v1(xq16, sa16, sb_v1)))
        legacy = (  # what the script tried before (older releases)
            ("M-major activation scales, [K/128, N/128] weight scales", xs.t().contiguous().t(), ws.t()),
            (
                "M-major activation scales, contiguous [K/128, N/128]",
                xs.t().contiguous().t(),
                ws.t().contiguous(),
            ),
            ("contiguous scales", xs.contiguous(), ws.contiguous()),
            (
                "M-major activation scales, [N/128, K/128] weight scales",
                xs.t().contiguous().t(),
                ws.contiguous(),
            ),
        )
        for label, s_a, s_b in legacy:
            configs.append((f"torch._scaled_mm, {label}", lambda s_a=s_a, s_b=s_b: v1(xq, s_a, s_b)))
    return configs


_REPORTED: set[str] = set()


def scaled_mm_call(x: torch.Tensor, w, dense: torch.Tensor) -> Callable | None:
    """The first of :func:`scaled_mm_configs` that runs and agrees with ``x @ dense.T`` (relative
    error under 10%: a scale layout read the wrong way round gives O(1) errors), or ``None``.

    Prints every failure's full message (each distinct message once) when none works, and the
    failures before the one used otherwise.
    """
    want = (x @ dense.t()).float()
    failures = []
    for label, call in scaled_mm_configs(x, w):
        try:
            got = call().float()
            torch.cuda.synchronize()
            rel = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
            if not rel < 0.1:
                raise ValueError(f"wrong results: relative error {rel:.3g} against the bf16 matmul")
        except Exception as exc:  # the next configuration
            failures.append((label, f"{type(exc).__name__}: {exc}"))
            continue
        if failures:
            print(f"  (torch scaled_mm: using {label!r}; before it: {', '.join(f for f, _ in failures)})")
            for failed, message in failures:
                _report(failed, message)
        call.__name__ = "scaled_mm"
        return call
    print(f"  (torch block-scaled FP8 GEMM unavailable for x {tuple(x.shape)}: every configuration failed)")
    for failed, message in failures:
        _report(failed, message)
    return None


def _report(label: str, message: str) -> None:
    if message in _REPORTED:
        print(f"    {label}: (the same error as printed above)")
        return
    _REPORTED.add(message)
    print(f"    {label}: {message}")
