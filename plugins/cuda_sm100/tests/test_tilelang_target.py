"""The TileLang kernels' compile target (:mod:`deepinfer_cuda_sm100.tl.target`) and the offline
precompile it allows (``python -m deepinfer_cuda_sm100.tl.precompile --arch 9.0``).

Here (no GPU): the capability named by ``DEEPINFER_TILELANG_ARCH`` is parsed or refused with the
variable's name; without it the target is TileLang's own ``"cuda"``; the PDL prologue follows the
named capability; the precompile refuses a malformed ``--arch`` in one line.  Where TileLang
imports: the offline target is, attribute for attribute, the one TileLang picks itself on a
device of that capability (its CUDA detection fed that capability, as it reads it from torch),
so the disk-cache keys of kernels compiled offline are the GPU machine's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch
from deepinfer_cuda_sm100.tl import pdl, precompile, target

needs_tilelang = pytest.mark.skipif(
    importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed"
)


def test_the_capability_is_read_from_the_environment_and_a_bad_one_names_the_variable(monkeypatch):
    monkeypatch.delenv(target.ARCH_ENV, raising=False)
    assert target.target_capability() is None and target.cuda_target() == "cuda"
    monkeypatch.setenv(target.ARCH_ENV, "9.0")
    assert target.target_capability() == (9, 0)
    monkeypatch.setenv(target.ARCH_ENV, " 10.3 ")
    assert target.target_capability() == (10, 3)
    for bad in ("sm_90", "9", "9.x", "6.1", "9.0.1"):
        monkeypatch.setenv(target.ARCH_ENV, bad)
        with pytest.raises(ValueError, match=target.ARCH_ENV):
            target.target_capability()


@pytest.mark.parametrize(
    "arch, env, expected",
    [("9.0", {}, True), ("8.0", {}, False), ("9.0", {"DEEPINFER_TILELANG_PDL": "0"}, False)]
    + [("9.0", {"DEEPINFER_CUDA_PDL": "0"}, False), ("10.0", {}, True)],
)
def test_kernels_built_for_a_named_capability_take_the_pdl_prologue_where_it_does(
    monkeypatch, arch, env, expected
):
    """No GPU here: the prologue follows the named capability (PDL from 9.0), not this machine."""
    monkeypatch.setenv(target.ARCH_ENV, arch)
    for name in ("DEEPINFER_TILELANG_PDL", "DEEPINFER_CUDA_PDL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert pdl.tl_pdl_enabled() is expected


def test_without_a_named_capability_the_prologue_is_this_machines(monkeypatch):
    monkeypatch.delenv(target.ARCH_ENV, raising=False)
    monkeypatch.delenv("DEEPINFER_TILELANG_PDL", raising=False)
    assert pdl.tl_pdl_enabled() is pdl.pdl_enabled()


def test_precompile_refuses_a_malformed_arch_in_one_line(monkeypatch, capsys):
    monkeypatch.delenv(target.ARCH_ENV, raising=False)
    assert precompile.main(["--arch", "sm_90"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    from deepinfer_cuda_sm100.tl import tilelang_problem

    problem = tilelang_problem()
    assert (
        ("--arch 'sm_90' is not a compute capability" in err[0]) if problem is None else (problem in err[0])
    )


def test_precompile_sizes_the_gemm_plans_for_the_given_sms():
    a = precompile.parse_args(["--sms", "78", "--gemm-shapes", "4096x1024", "--grouped-shapes", ""])
    gemms = [c for module, c in precompile.jobs(a) if module == "fp8_gemm"]
    assert gemms == precompile.gemm_configurations("4096x1024", 78)
    assert gemms != precompile.gemm_configurations("4096x1024", 132)


@needs_tilelang
@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_the_offline_target_is_the_one_tilelang_picks_on_such_a_device(monkeypatch, capability):
    """TileLang resolves ``target="cuda"`` from torch's view of the current device; fed that
    capability, it gives the very target (and so the cache keys) the named capability gives."""
    from tilelang.backend.target import determine_target

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    on_device = determine_target("cuda", return_object=True)
    monkeypatch.setenv(target.ARCH_ENV, "{}.{}".format(*capability))
    offline = determine_target(target.cuda_target(), return_object=True)
    assert str(offline) == str(on_device)
    assert str(offline.attrs["arch"]).startswith("sm_{}{}".format(*capability))


def _wheel(site, files: dict[str, str]) -> None:
    """An installed ``nvidia-cuda-nvcc`` distribution in ``site``: its metadata, its ``RECORD``
    and the files it lists."""
    info = site / "nvidia_cuda_nvcc-13.0.88.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-cuda-nvcc\nVersion: 13.0.88\n")
    (info / "RECORD").write_text("".join(f"{name},,\n" for name in files))
    for name, text in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)


def test_nvcc_is_found_in_the_nvidia_cuda_nvcc_wheel_where_no_toolkit_is(tmp_path, monkeypatch):
    """TileLang's ``nvcc`` extra (``[tilelang-nvcc]``) brings nvcc as a wheel: without it on
    ``PATH`` or under a toolkit root, the wheel's nvcc is the one, and without the wheel none."""
    from deepinfer_cuda_sm100.tl import find_nvcc

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    try:
        importlib.metadata.distribution("nvidia-cuda-nvcc")
    except importlib.metadata.PackageNotFoundError:  # (where the wheel is installed, it is found)
        assert find_nvcc([]) is None
    _wheel(tmp_path / "site", {"nvidia/cuda_nvcc/bin/nvcc": "", "nvidia/cuda_nvcc/include/cuda.h": ""})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert find_nvcc([]) == str(tmp_path / "site" / "nvidia" / "cuda_nvcc" / "bin" / "nvcc")
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    (tmp_path / "cuda" / "bin" / "nvcc").write_text("")
    assert find_nvcc([None, str(tmp_path / "cuda")]) == str(tmp_path / "cuda" / "bin" / "nvcc")


def test_a_malformed_arch_variable_keeps_tilelang_out_and_says_why(monkeypatch):
    """The engine's one check (``tilelang_problem``) names the variable, so Triton serves with one
    warning instead of a kernel build failing inside a request."""
    from deepinfer_cuda_sm100.tl import tilelang_problem

    monkeypatch.setenv(target.ARCH_ENV, "hopper")
    tilelang_problem.cache_clear()
    try:
        problem = tilelang_problem()
    finally:
        tilelang_problem.cache_clear()
    assert problem == f"{target.ARCH_ENV}: {target.capability_problem('hopper')}"
