"""Programmatic dependent launch of the Triton kernels (:mod:`deepinfer_cuda_sm100.kernels.pdl`):
off where it cannot run (the CPU, Triton's interpreter), on for SM90 and later unless
``DEEPINFER_CUDA_PDL=0``, and a chain of dependent kernels replayed in a CUDA graph with it
gives the bits of the same chain launched eagerly without it; the TileLang kernels' switch
(:mod:`deepinfer_cuda_sm100.tl.pdl`) follows it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from deepinfer_cuda_sm100.kernels import pdl


def test_off_without_a_cuda_device():
    """On a machine without CUDA (or under the interpreter) a launch gets no PDL keywords, so
    every kernel compiles and launches as it would without the module."""
    if torch.cuda.is_available() and not pdl.INTERPRETED:
        pytest.skip("a CUDA device is present: the GPU tests below cover it")
    assert not pdl.pdl_enabled()
    assert pdl.pdl_args() == {}


@pytest.mark.gpu
def test_on_for_sm90_and_later():
    on = torch.cuda.get_device_capability()[0] >= 9 and os.environ.get(pdl.ENV, "1") != "0"
    assert pdl.pdl_enabled() is on
    assert pdl.pdl_args() == ({"USE_PDL": True, "launch_pdl": True} if on else {})


@pytest.mark.gpu
def test_environment_turns_it_off():
    code = "from deepinfer_cuda_sm100.kernels import pdl; print(pdl.pdl_enabled(), pdl.pdl_args())"
    env = {**os.environ, pdl.ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "{}"]


@pytest.mark.parametrize("arch", [90, 100])
def test_kernels_compile_with_and_without_pdl(arch):
    """Compiled for the GPU (no GPU needed): ``USE_PDL`` adds the wait and the trigger, in that
    order and before the first global load; the default compiles without either."""
    pytest.importorskip("triton")
    from cuda_sm100_checks import compile_typed
    from deepinfer_cuda_sm100.kernels import norm

    args = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "n_rows": "i32", "D": "i32"}
    args |= {"stride_x": "i32", "eps": "fp32"}
    consts = {"HAS_WEIGHT": True, "FACTOR_IN_X_DTYPE": False, "BLOCK_R": 4, "BLOCK_D": 512, "NUM_TILES": 8}
    plain = compile_typed(norm._rms_norm_kernel, args, consts, arch, num_warps=4).asm["ptx"]
    assert "griddepcontrol" not in plain
    ptx = compile_typed(norm._rms_norm_kernel, args, consts | {"USE_PDL": True}, arch, num_warps=4).asm["ptx"]
    wait, trigger = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    assert 0 <= wait < trigger < ptx.find("ld.global"), "the wait first, then the trigger, then the loads"


def _chain(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` dependent launches: each normalises the previous output (read right after the
    previous kernel wrote it)."""
    from deepinfer_cuda_sm100.kernels.norm import rms_norm

    for _ in range(n):
        x = rms_norm(x * 1.5, w, 1e-6)
    return x


@pytest.mark.gpu
def test_graph_replay_with_pdl_equals_eager_without(monkeypatch):
    if not pdl.pdl_enabled():
        pytest.skip("PDL needs compute capability 9 or more")
    from deepinfer_cuda_sm100.kernels import norm

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 4096, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.rand(4096, generator=g, device="cuda").to(torch.bfloat16) + 0.5
    _chain(x, w, 2)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, w, 48)
    graph.replay()
    torch.cuda.synchronize()
    kernels = norm._rms_norm_kernel.device_caches[torch.cuda.current_device()][0].values()
    assert any("griddepcontrol.wait" in k.asm["ptx"] for k in kernels), "no kernel compiled with PDL"

    monkeypatch.setenv(pdl.ENV, "0")
    pdl._enabled.cache_clear()
    try:
        assert pdl.pdl_args() == {}
        expected = _chain(x, w, 48)
    finally:
        monkeypatch.delenv(pdl.ENV)
        pdl._enabled.cache_clear()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_the_tilelang_kernels_follow_the_triton_ones_unless_turned_off(monkeypatch):
    """``tl.pdl.tl_pdl_enabled``: off wherever the Triton kernels' PDL is off; where it is on,
    on unless ``DEEPINFER_TILELANG_PDL=0``."""
    from deepinfer_cuda_sm100.tl import pdl as tl_pdl

    for triton_on in (False, True):
        monkeypatch.setattr(tl_pdl, "pdl_enabled", lambda on=triton_on: on)
        monkeypatch.delenv(tl_pdl.ENV, raising=False)
        assert tl_pdl.tl_pdl_enabled() is triton_on
        monkeypatch.setenv(tl_pdl.ENV, "0")
        assert tl_pdl.tl_pdl_enabled() is False
        monkeypatch.setenv(tl_pdl.ENV, "1")
        assert tl_pdl.tl_pdl_enabled() is triton_on
