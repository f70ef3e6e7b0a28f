"""The cpu plugin: registration, its probe, its kernels against the reference (the conformance
suite), its refusals, and the engine on it against the reference backend."""

from __future__ import annotations

import pytest
import torch
from cpu_cases import OWN_CASES
from deepinfer_cpu import build, plugin
from deepinfer_cpu.ops import PROVIDED_OPS

from deepinfer_core.backends import resolve_backend
from deepinfer_core.ops import OpTable, get_op
from deepinfer_core.ops.kv_format import Fp8KVPool
from deepinfer_core.ops.modes import batch_invariant_mode
from deepinfer_core.plugins import get_plugins
from deepinfer_core.testing import conformance_cases, manager_with_plugin
from deepinfer_core.testing.availability import backend_unavailable_reason

UNAVAILABLE = backend_unavailable_reason("cpu")
needs_backend = pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")


def test_plugin_registers_the_cpu_backend():
    spec = manager_with_plugin(plugin, "cpu").get_backend("cpu")
    assert (spec.device_type, spec.supports_graph_capture, spec.batch_invariant_devices) == (
        "cpu",
        False,
        ("cpu",),
    )
    assert spec.priority > 0  # above the reference's 0: `auto` picks it


def test_entry_point_is_installed():
    row = next((r for r in get_plugins().report() if r["name"] == "cpu"), None)
    assert row is not None, "install the plugin: pip install -e plugins/cpu"
    assert row["status"] == "loaded" and row["dist"] == "deepinfer-cpu"
    assert [b["name"] for b in row["backends"]] == ["cpu"]


def test_probe_without_a_compiler_or_built_kernels_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path))
    ok, reason = manager_with_plugin(plugin, "cpu").get_backend("cpu").is_available()
    assert not ok and "no C++ compiler" in reason and str(tmp_path) in reason
    assert "python -m deepinfer_cpu.build" in reason and "\n" not in reason


def test_cache_folder_follows_deepinfer_kernel_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_KERNEL_CACHE", str(tmp_path))
    assert build.library_path().parent.parent == tmp_path
    assert build.library_path().parent.name.startswith("cpu-kernels-")


@pytest.mark.parametrize("case", conformance_cases("cpu", dtypes=(torch.float32,), cases=OWN_CASES), ids=str)
def test_conformance_float32(case):
    case.check()


@pytest.fixture(scope="module")
def cpu_ops():
    return get_plugins().get_backend("cpu").load_ops()


@needs_backend
@pytest.mark.parametrize("name", PROVIDED_OPS)
def test_kernels_at_the_tiny_models_decode_shape_run_without_fallback(name, cpu_ops):
    """Each op at the tiny model's decode shape, under ``strict_ops`` (the kernel, not the
    reference, runs), within the fp32 tolerance of the reference (the sums run in another
    order than ATen's kernels)."""
    table = OpTable(cpu_ops, backend="cpu", strict=True)
    args, kwargs = OWN_CASES[name](torch.Generator().manual_seed(0), torch.float32)[0]
    got, want = table[name](*args, **kwargs), get_op(name).reference(*args, **kwargs)
    for g, w in zip(
        got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,), strict=True
    ):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        assert g.shape == w.shape and g.dtype == w.dtype


@needs_backend
@pytest.mark.parametrize("name", PROVIDED_OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_are_refused_and_run_on_the_reference(name, dtype, cpu_ops):
    impl = cpu_ops[name]
    args, kwargs = get_op(name).sample_cases(torch.Generator().manual_seed(0), dtype)[0]
    verdict = impl.supports(*args, **kwargs)
    assert isinstance(verdict, str) and str(dtype) in verdict and "float32" in verdict
    table = OpTable({name: impl}, backend="cpu")
    got, want = table[name](*args, **kwargs), get_op(name).reference(*args, **kwargs)
    for g, w in zip(
        got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,), strict=True
    ):
        assert torch.equal(g, w)


@needs_backend
def test_int32_positions_are_refused_before_the_kernel(cpu_ops):
    args, kwargs = get_op("compress_entries").sample_cases(torch.Generator().manual_seed(0), torch.float32)[0]
    args = (*args[:4], args[4].to(torch.int32), *args[5:])
    verdict = cpu_ops["compress_entries"].supports(*args, **kwargs)
    assert isinstance(verdict, str) and "positions" in verdict and "int64" in verdict


@needs_backend
@pytest.mark.parametrize(
    ("fused", "parts"),
    [
        ("compress_windows", ["compress_entries"]),
        ("hc_post_pre", ["hc_post", "hc_pre", "rms_norm"]),
        ("qk_norm_rope", ["rms_norm", "rms_norm", "apply_rope", "apply_rope"]),
        ("hc_head_norm", ["hc_head", "rms_norm"]),
    ],
)
def test_fused_ops_run_as_their_parts_on_the_cpu_kernels(fused, parts):
    _, ops = resolve_backend("cpu", strict_ops=True)
    assert ops.sources[fused] == "decomposed" and all(ops.sources[p] == "backend+fallback" for p in parts)
    called = []
    # the table's own callables, wrapped to see the decomposition reach them
    for part in dict.fromkeys(parts):
        kernel = getattr(ops, part)
        setattr(ops, part, lambda *a, _k=kernel, _p=part, **kw: called.append(_p) or _k(*a, **kw))
    args, kwargs = get_op(fused).sample_cases(torch.Generator().manual_seed(0), torch.float32)[0]
    got = ops[fused](*args, **kwargs)
    want = get_op(fused).reference(*args, **kwargs)
    assert called == parts
    for g, w in zip(got, want, strict=True):
        if g is not None:
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@needs_backend
def test_auto_picks_the_cpu_backend_and_every_core_op_resolves_without_fallback_warnings(caplog):
    with caplog.at_level("WARNING", logger="deepinfer.ops"):
        spec, ops = resolve_backend("auto", strict_ops=True)
    assert spec.name == "cpu"
    assert {n for n, s in ops.sources.items() if s == "backend+fallback"} == set(PROVIDED_OPS)
    assert {n for n, s in ops.sources.items() if s == "decomposed"} == {
        "compress_windows",
        "hc_post_pre",
        "qk_norm_rope",
        "hc_head_norm",
    }
    assert not caplog.records


@needs_backend
@pytest.mark.slow
def test_greedy_tokens_equal_the_reference_backends_on_the_tiny_model():
    from deepinfer_core import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [1, *range(5 + i, 9 + 5 * i)]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "cpu"):
        llm = LLM(backend=backend, dtype="float32", strict_ops=backend == "cpu")
        assert llm.engine.backend.name == backend
        tokens[backend] = [
            list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert tokens["cpu"] == tokens["reference"]
    assert len({len(t) for t in tokens["cpu"]}) == 1 and len(tokens["cpu"][0]) == 24


def _packed_cases() -> dict[str, tuple[tuple, str]]:
    """Per pool-reading op, a float32 call whose pool is packed (``kv_cache_dtype="fp8"``), and
    the pool's class name the refusal must give."""
    g = torch.Generator().manual_seed(0)
    attn = get_op("sparse_attention").sample_cases(g, torch.float32)[2][0]  # an Fp8KVPool ring
    topk = get_op("indexer_topk").sample_cases(g, torch.float32)[2][0]  # V4.1's MXFP4 keys
    entries = list(get_op("compress_entries").sample_cases(g, torch.float32)[0][0])
    entries[7] = Fp8KVPool.zeros(entries[7].shape[0], entries[7].shape[1], 8, torch.device("cpu"))
    return {
        "sparse_attention": (attn, "Fp8KVPool"),
        "indexer_topk": (topk, "BlockScaledKVPool"),
        "compress_entries": (tuple(entries), "Fp8KVPool"),
    }


@needs_backend
@pytest.mark.parametrize("name", ["sparse_attention", "indexer_topk", "compress_entries"])
def test_packed_pools_are_refused_and_run_on_the_reference(name, cpu_ops):
    args, pool_class = _packed_cases()[name]
    verdict = cpu_ops[name].supports(*args)
    assert isinstance(verdict, str) and pool_class in verdict and "plain float32 tensor pools" in verdict
    table = OpTable({name: cpu_ops[name]}, backend="cpu")
    got = table[name](*args)
    want = get_op(name).reference(*args)
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    else:  # the packed pool itself, written in place by both: the same bytes
        assert got is args[7]


@needs_backend
@pytest.mark.parametrize("name", [pytest.param("sparse_attention", marks=pytest.mark.slow), "indexer_topk"])
def test_batch_invariant_mode_gives_the_references_results(name, cpu_ops):
    """In the mode the kernels run too (a query's result depends only on its valid keys /
    candidates, in order): attention within the fp32 tolerance of the reference's blocked
    online softmax, the indexer's picks equal to the reference's, in candidate column order."""
    table = OpTable(cpu_ops, backend="cpu", strict=True)
    reordered = False
    for args, kwargs in OWN_CASES[name](torch.Generator().manual_seed(3), torch.float32):
        with batch_invariant_mode():
            got, want = table[name](*args, **kwargs), get_op(name).reference(*args, **kwargs)
        if name == "indexer_topk":
            assert torch.equal(got, want)
            reordered |= not torch.equal(got, table[name](*args, **kwargs))  # best-first outside
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert reordered or name != "indexer_topk"


@needs_backend
@pytest.mark.slow
def test_batch_invariant_engine_logprobs_identical_alone_batched_and_chunked():
    """``batch_invariant=True`` on the ``cpu`` backend (its kernels under ``strict_ops``): a
    request's tokens and logprobs are bitwise the same alone, beside 7 others, and with its
    prompt in other chunks (the indexer's top-k is active: 50 tokens > 4 x 4 entries)."""
    from deepinfer_core import LLM, SamplingParams

    g = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(4, 500, (n,), generator=g).tolist()  # noqa: E731
    target = {"prompt_token_ids": ids(50)}
    others = [{"prompt_token_ids": ids(10 + 13 * j)} for j in range(7)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    outs = []
    for budget, batch in ((64, [target]), (16, [*others[:3], target, *others[3:]])):
        llm = LLM(backend="cpu", batch_invariant=True, strict_ops=True, max_num_batched_tokens=budget)
        assert llm.engine.backend.name == "cpu"
        results = llm.generate(batch, params, use_tqdm=False)
        outs.append(results[batch.index(target)].outputs[0])
    alone, batched = outs
    assert alone.token_ids == batched.token_ids and len(alone.token_ids) == 8
    assert alone.logprobs is not None and alone.logprobs == batched.logprobs  # exact floats
