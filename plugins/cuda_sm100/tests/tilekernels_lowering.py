"""Lower the TileKernels kernels the adapters call, for sm_90 at V4-Flash shapes, without a GPU.

TileLang lowers a kernel to CUDA source on any machine (``tilelang.lower``); compiling it needs
``nvcc`` and running it a GPU.  :func:`lowering_failures` builds each kernel the adapters of
:mod:`deepinfer_cuda_sm100.tk` launch, with the static arguments the adapters give it at V4-Flash
shapes, and lowers it.  Two of TileKernels' host helpers ask the device for a number (the vector
width of the cast kernels, the shared memory per SM of the Engram gate); without a GPU they get
the H200's values.
"""

from __future__ import annotations

from collections.abc import Callable


def _kernels() -> dict[str, Callable]:
    import tile_kernels.engram.engram_gate_fwd_cuda as gate_mod
    import tile_kernels.quant.common as quant_common
    import tile_kernels.quant.per_token_cast_and_cast_back_cuda as qdq_mod
    import torch
    from tile_kernels.engram.engram_hash_cuda import get_engram_hash_kernel_cuda
    from tile_kernels.mhc.post_cuda import mhc_post_fwd_cuda
    from tile_kernels.mhc.pre_apply_mix_cuda import mhc_pre_apply_mix_fwd_cuda
    from tile_kernels.mhc.pre_big_fuse_cuda import mhc_pre_big_fuse_fwd_cuda
    from tile_kernels.moe.moe_topk_gate_forward_cuda import get_moe_topk_gate_forward_kernel_cuda
    from tile_kernels.transform.rope_cuda import get_rope_kernel_cuda
    from tilelang import language as T

    if not torch.cuda.is_available():
        qdq_mod.get_best_vectorize_size = lambda dtype: 16 // dtype.bytes  # sm90: 16-byte vectors
        gate_mod.get_max_smem_per_sm = lambda: 228 * 1024  # H200
    cfg = quant_common.get_cast_output_config
    qdq = qdq_mod.get_per_token_cast_and_cast_back_kernel_cuda
    t, n, d, bf = 64, 4, 4096, torch.bfloat16
    m, e = (2 + n) * n, torch.empty
    return {
        "mhc_pre_big_fuse_fwd": lambda: mhc_pre_big_fuse_fwd_cuda.get_tir(
            e(1, t, m), e(1, t), e(3), e(m), e(t, n, d, dtype=bf), e(t, n), e(t, n * n), e(t, d, dtype=bf),
            1e-6, 1e-6, 1e-6, 2.0, 20, 512, n_splits=1,
        ),
        "mhc_post_fwd": lambda: mhc_post_fwd_cuda.get_tir(
            e(t, n, n), e(t, n, d, dtype=bf), e(t, n), e(t, d, dtype=bf), e(t, n, d, dtype=bf),
            vec=8, h_blk=1024,
        ),
        "mhc_pre_apply_mix_fwd": lambda: mhc_pre_apply_mix_fwd_cuda.get_tir(
            e(t, n, d, dtype=bf), e(t, n), e(t, d, dtype=bf), n_thr=64, h_blk=1024
        ),
        "apply_rotary [T, 64, 512]": lambda: get_rope_kernel_cuda.get_tir(
            T.bfloat16, T.int32, 64, 64, False, True, True, False, 64, 64 * 512, 512
        ),
        "apply_rotary [T, 512]": lambda: get_rope_kernel_cuda.get_tir(
            T.bfloat16, T.int32, 1, 64, False, True, True, False, 64, 512, 512
        ),
        "moe_topk_gate_forward top-6 of 256, bias": lambda: get_moe_topk_gate_forward_kernel_cuda.get_tir(
            6, 256, False, False, False, False, True, False, False, False
        ),
        "moe_topk_gate_forward hash": lambda: get_moe_topk_gate_forward_kernel_cuda.get_tir(
            6, 256, False, True, True, False, False, False, False, False
        ),
        "per_token_cast_and_cast_back e4m3/32 of 512": lambda: qdq.get_tir(
            512, 512, T.bfloat16, cfg("e4m3", (1, 32), round_sf=True)
        ),
        "per_token_cast_and_cast_back e2m1/32 of 128": lambda: qdq.get_tir(
            128, 128, T.bfloat16, cfg("e2m1", (1, 32), round_sf=True)
        ),
        "engram_hash 4-grams, 8 heads": lambda: get_engram_hash_kernel_cuda.get_tir(4, 1, 8),
        "engram_gate_fwd 4 x 4096": lambda: gate_mod.get_engram_gate_fwd_kernel_cuda.get_tir(
            4096, 1e-6, 4096**-0.5, 132, 1e-6, 4, False, False, False
        ),
    }  # fmt: skip


def lowering_failures() -> list[str]:
    """``"<kernel>: <error>"`` for each kernel that does not lower for sm_90 (none: all lower)."""
    import tilelang
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": "sm_90"})
    failures = []
    for name, build in _kernels().items():
        try:
            with target:
                tilelang.lower(build(), target=target)
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {str(exc).strip()[-300:]}")
    return failures
