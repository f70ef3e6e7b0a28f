"""DeepSeek's TileKernels in the ``cuda_sm100`` backend: adapters, the measured choice, dispatch.

**Here** (no GPU; TileKernels absent unless installed): the probe's one-line reason, the choice
between an op's own implementation and TileKernels (nearest measured point, the own language
outside the measured range and without a table, the ops the table shows TileKernels winning),
the table writer keeping other ops' points in a file :func:`kernel_choice.load_points` reads,
each adapter's refusals (with the reason), and a dispatcher serving every call with the op's own
implementation, logging once, where TileKernels cannot run.  With TileKernels and TileLang
importable (no GPU needed), the kernels the adapters call lower for sm_90 at V4-Flash shapes.

**GPU** (marked ``gpu``; skipped where TileKernels cannot run): every adapter against the
reference op on the op's own conformance cases and at V4-Flash shapes (within the op's
tolerances, integer outputs exactly, the UE8M0 ``kv_qdq`` bit for bit), a row alone bitwise
equal to the same row in a batch for the adapters declared row independent, and replay of a
captured CUDA graph on new inputs bitwise equal to an eager call.
"""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest
import torch
from deepinfer_cuda_sm100 import kernel_choice, tk, tk_dispatch
from deepinfer_cuda_sm100.tk.cases import VARIANTS

from deepinfer_core.models.deepseek_v41 import ops as v41_ops  # noqa: F401  (defines V4.1's ops)
from deepinfer_core.ops.registry import DEFAULT_TOLERANCES, get_op
from deepinfer_core.testing.compare import compare

BOTH = frozenset({"triton", "tilekernels"})


def _point(op: str, tokens: int, own: float, tkm: float, own_lang: str = "triton") -> kernel_choice.Point:
    return kernel_choice.Point(
        op, "streams", "bfloat16", 4, 4096, tokens, 0, {own_lang: own, "tilekernels": tkm}
    )


def test_every_adapted_op_has_an_own_language_and_v4_flash_inputs():
    adapters = tk.adapters()
    assert set(adapters) == set(tk_dispatch.OWN_LANGUAGE) == set(VARIANTS)
    for op, a in adapters.items():
        assert a.op == op and a.kernels and get_op(op).name == op


@pytest.mark.skipif(importlib.util.find_spec("tile_kernels") is not None, reason="TileKernels is installed")
def test_probe_names_the_missing_package_and_how_to_install_it():
    problem = tk.tilekernels_problem()
    assert problem is not None and "\n" not in problem
    assert "not installed" in problem and "plugins/cuda_sm100[tilekernels]" in problem


def test_choice_is_the_faster_source_at_the_nearest_point_and_own_elsewhere():
    points = (_point("hc_post", 1, own=2.0, tkm=1.0), _point("hc_post", 256, own=1.0, tkm=3.0))

    def choose(tokens, available=BOTH, arch="sm90"):
        return kernel_choice.choose(
            "hc_post", "streams", "bfloat16", 4, 4096, tokens, 0, arch, available, points=points
        )

    assert choose(2) == "tilekernels"  # nearest: 1 token
    assert choose(200) == "triton"  # nearest: 256 tokens
    assert choose(512) == "triton"  # past the measured range
    assert choose(2, available=frozenset({"triton"})) == "triton"
    ref = (_point("deepseek_v41.kv_qdq", 16, own=2.0, tkm=3.0, own_lang="reference"),)
    own = kernel_choice.choose(
        "deepseek_v41.kv_qdq", "streams", "bfloat16", 4, 4096, 999, 0, "sm90",
        frozenset({"reference", "tilekernels"}), points=ref, default="reference",
    )  # fmt: skip
    assert own == "reference"


def test_measured_wins_are_the_ops_tilekernels_beat_somewhere():
    points = (
        _point("hc_post", 1, own=2.0, tkm=1.0),
        _point("hc_post", 64, own=1.0, tkm=3.0),
        _point("hc_pre", 1, own=1.0, tkm=3.0),
        _point("deepseek_v41.engram_mix", 1, own=5.0, tkm=1.0, own_lang="reference"),
        kernel_choice.Point("moe_route", "hash", "float32", 256, 6, 1, 0, {"triton": 1.0}),
    )
    assert tk_dispatch.measured_wins("sm90", points) == {"hc_post", "deepseek_v41.engram_mix"}


def test_merge_points_replaces_the_shapes_it_measured_and_keeps_the_others(tmp_path):
    path = tmp_path / "choices.json"
    shipped = json.loads(kernel_choice.table_path("sm90").read_text())
    shipped["points"] = [p for p in shipped["points"] if p["op"] != "hc_post"]
    path.write_text(json.dumps(shipped))
    first = [{**_point("hc_post", t, 3.0, 1.0).__dict__} for t in (1, 64)]
    kernel_choice.merge_points("sm90", first, {"command": "bench"}, path=path)
    new = [{**_point("hc_post", 1, 2.0, 1.0).__dict__}]
    kernel_choice.merge_points("sm90", new, {"command": "bench"}, path=path)
    kernel_choice.merge_points("sm90", new, {"command": "bench"}, path=path)  # twice: replaced, not added
    table = json.loads(path.read_text())
    ops = [p["op"] for p in table["points"]]
    assert ops.count("hc_post") == 2  # the 1-token point replaced, the 64-token point kept
    by_tokens = {p["tokens"]: p["ms"] for p in table["points"] if p["op"] == "hc_post"}
    assert by_tokens == {1: {"triton": 2.0, "tilekernels": 1.0}, 64: {"triton": 3.0, "tilekernels": 1.0}}
    assert ops.count("sparse_attention") == sum(p["op"] == "sparse_attention" for p in shipped["points"]) > 0
    assert table["sources"]["hc_post"] == {"command": "bench"}
    loaded = [kernel_choice.Point(**p) for p in table["points"]]  # the form load_points reads
    assert loaded[-1].ms == {"triton": 2.0, "tilekernels": 1.0}
    with pytest.raises(ValueError, match="exactly the fields"):
        kernel_choice.merge_points("sm90", [{"op": "hc_post"}], {}, path=path)


def test_adapters_refuse_what_tilekernels_does_not_take_with_the_reason():
    a = tk.adapters()
    bf = torch.bfloat16
    s = torch.zeros(3, 4, 4096, dtype=bf)
    assert "bfloat16" in a["hc_post"].supports(
        torch.zeros(3, 4096), s.float(), torch.zeros(3, 4), torch.zeros(3, 4, 4)
    )
    assert "multiples of 128" in a["hc_post"].supports(
        torch.zeros(3, 96, dtype=bf), torch.zeros(3, 4, 96, dtype=bf), torch.zeros(3, 4), torch.zeros(3, 4, 4)
    )
    assert "on cpu" in a["hc_post"].supports(
        torch.zeros(3, 4096, dtype=bf), s, torch.zeros(3, 4), torch.zeros(3, 4, 4)
    )
    fn, base, scale = torch.zeros(24, 4 * 4096), torch.zeros(24), torch.ones(3)
    assert "int >= 1" in a["hc_pre"].supports(s, fn, base, scale, 1e-6, 1e-6, 0)
    cos = torch.zeros(3, 16, dtype=bf)
    assert "(64, 128)" in a["apply_rope"].supports(torch.zeros(3, 2, 64, dtype=bf), cos, cos)
    half = torch.zeros(3, 32, dtype=torch.float16)
    assert "bf16, fp32" in a["apply_rope"].supports(torch.zeros(3, 2, 512, dtype=torch.float16), half, half)
    logits = torch.zeros(3, 256)
    assert "sqrtsoftplus only" in a["moe_route"].supports(logits, None, None, 6, "sigmoid", 1.0)
    assert "float32" in a["moe_route"].supports(logits.to(bf), None, None, 6, "sqrtsoftplus", 1.0)
    assert "multiples of 4" in a["moe_route"].supports(torch.zeros(3, 10), None, None, 2, "sqrtsoftplus", 1.0)
    assert "fp4_e4m3 rounds differently" in a["deepseek_v41.kv_qdq"].supports(
        torch.zeros(3, 64, dtype=bf), "fp4_e4m3", 16
    )
    assert "multiples of 64" in a["deepseek_v41.kv_qdq"].supports(
        torch.zeros(3, 96, dtype=bf), "fp8_ue8m0", 32
    )
    w = torch.ones(4, 256)
    mix = a["deepseek_v41.engram_mix"].supports(
        torch.zeros(3, 4, 256, dtype=bf), torch.zeros(3, 5 * 256, dtype=bf), w, w, 1e-6
    )
    assert "at least two blocks" in mix


@pytest.mark.skipif(importlib.util.find_spec("tile_kernels") is not None, reason="TileKernels is installed")
def test_dispatcher_serves_every_call_with_its_own_and_logs_once_without_tilekernels(caplog):
    op = "deepseek_v41.hc_collapse"
    reference = get_op(op).reference
    dispatch = tk_dispatch.make_dispatcher(op, reference, tk.adapters()[op])
    streams, pre = torch.randn(5, 4, 64, dtype=torch.bfloat16), torch.rand(5, 4)
    tk_dispatch._warn_unavailable.cache_clear()
    with caplog.at_level(logging.WARNING, logger="deepinfer.cuda_sm100"):
        outs = [dispatch(streams, pre) for _ in range(3)]
    assert all(torch.equal(o, reference(streams, pre)) for o in outs)
    warned = [r for r in caplog.records if op in r.getMessage()]
    assert len(warned) == 1 and "not installed" in warned[0].getMessage()
    tk_dispatch._log_absent.cache_clear()
    with caplog.at_level(logging.INFO, logger="deepinfer.cuda_sm100"):
        assert tk_dispatch.tilekernels_ops({}, "sm90") == {}
        assert tk_dispatch.tilekernels_ops({}, "sm90") == {}
    assert sum("TileKernels:" in r.getMessage() for r in caplog.records) == 1


# ---- lowering (TileKernels and TileLang importable; no GPU needed) -------------------------------
@pytest.mark.slow
def test_the_adapters_kernels_lower_for_sm90_at_v4_flash_shapes():
    pytest.importorskip("tile_kernels", reason="TileKernels is not installed")
    from tilekernels_lowering import lowering_failures

    failures = lowering_failures()
    assert not failures, "; ".join(failures)


# ---- GPU -----------------------------------------------------------------------------------------
def _needs_tilekernels():
    problem = tk.tilekernels_problem()
    if problem is not None:
        pytest.skip(problem)


def _check(op: str, args: tuple, dtype: torch.dtype) -> list[str]:
    adapter, spec = tk.adapters()[op], get_op(op)
    got, want = adapter.run(*args), spec.reference(*args)
    atol, rtol = spec.tolerances.get(dtype, DEFAULT_TOLERANCES[torch.float32])
    problems: list[str] = []
    compare(got, want, atol, rtol, "output", problems)
    outs = (got,) if isinstance(got, torch.Tensor) else tuple(got)
    refs = (want,) if isinstance(want, torch.Tensor) else tuple(want)
    if op == "deepseek_v41.kv_qdq" and not all(torch.equal(a, b) for a, b in zip(outs, refs, strict=True)):
        problems.append("not bit for bit the reference")
    return problems


def _cases(op: str) -> list[tuple[str, tuple, torch.dtype]]:
    """The op's own conformance cases (CUDA), and V4-Flash calls of 1, 7, 64 and 300 tokens."""
    from deepinfer_cuda_sm100.tk.cases import v4_flash_args

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for i, (args, _) in enumerate(get_op(op).sample_cases(torch.Generator().manual_seed(0), dtype)):
            moved = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
            out.append((f"own{i}-{dtype}", moved, dtype))
    for variant in VARIANTS[op]:
        for t in (1, 7, 64, 300):
            args = v4_flash_args(op, variant, t, torch.Generator().manual_seed(t))
            dtype = next(
                (a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()),
                torch.float32,
            )
            out.append((f"{variant}-T{t}", args, dtype))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(VARIANTS))
def test_adapter_matches_the_reference(op):
    _needs_tilekernels()
    adapter, problems, ran = tk.adapters()[op], [], 0
    for name, args, dtype in _cases(op):
        if adapter.supports(*args) is not True:
            continue
        ran += 1
        problems += [f"{name}: {p}" for p in _check(op, args, dtype)]
    assert ran >= 4, "the adapter took too few of the cases"
    assert not problems, "; ".join(problems[:8])


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(VARIANTS))
def test_adapter_rows_alone_and_graph_replay_are_bitwise(op):
    _needs_tilekernels()
    from deepinfer_cuda_sm100.tk.cases import ROW_ARGS, v4_flash_args

    adapter = tk.adapters()[op]
    args = v4_flash_args(op, VARIANTS[op][0], 37, torch.Generator().manual_seed(3))

    def outputs(a):
        out = adapter.run(*a)
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)

    full = outputs(args)
    if adapter.row_independent:
        for r in (0, 36):
            alone = outputs(
                tuple(
                    x[r : r + 1].clone() if i in ROW_ARGS[op] and x is not None else x
                    for i, x in enumerate(args)
                )
            )
            assert all(torch.equal(f[r : r + 1], o) for f, o in zip(full, alone, strict=True)), f"row {r}"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = outputs(args)
    fresh = v4_flash_args(op, VARIANTS[op][0], 37, torch.Generator().manual_seed(4))
    for i in ROW_ARGS[op]:
        if isinstance(args[i], torch.Tensor):
            args[i].copy_(fresh[i])
    graph.replay()
    assert all(torch.equal(c, e) for c, e in zip(captured, outputs(args), strict=True))
