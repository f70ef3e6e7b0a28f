"""The conformance suite: it passes correct backends and catches wrong ones."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends import BackendSpec
from deepinfer_core.errors import BackendError, OpNotSupportedError
from deepinfer_core.ops import OpImpl, OpSpec, all_ops, get_op, registry
from deepinfer_core.ops._cases import randn
from deepinfer_core.testing import check_backend, conformance_cases
from deepinfer_core.testing.compare import compare
from deepinfer_core.weights.quant import QuantizedTensor

REFERENCE = BackendSpec(
    name="reference_copy",
    device_type="cpu",
    ops=lambda: {name: OpImpl(fn=spec.reference) for name, spec in all_ops().items()},
)


def backend(**ops) -> BackendSpec:
    return BackendSpec(name="under_test", device_type="cpu", ops=ops)


def check(spec: BackendSpec, **kwargs):
    """``check_backend`` over the ops ``spec`` provides (not the fused ops it leaves to their
    decomposition, which the tests below of one op's checking do not mean to run)."""
    return check_backend(spec, **{"ops": _provided(spec), **kwargs})


def cases_of(spec: BackendSpec, **kwargs):
    """``conformance_cases`` over the ops ``spec`` provides (see :func:`check`)."""
    return conformance_cases(spec, **{"ops": _provided(spec), **kwargs})


def _provided(spec: BackendSpec) -> list[str]:
    try:
        return sorted(spec.load_ops())
    except BackendError:  # a backend whose ops fail to load: the call under test says so
        return []


def rms_norm_ref(x, weight, eps):
    return get_op("rms_norm").reference(x, weight, eps)


@pytest.mark.parametrize(
    "case", conformance_cases(REFERENCE, dtypes=(torch.float32, torch.bfloat16)), ids=str
)
def test_reference_conforms_to_itself(case):
    case.check()


def test_check_backend_by_name_runs_every_sample_case_of_every_op():
    report = check_backend("reference")
    expected = sum(len(spec.sample_cases(torch.Generator(), torch.float32)) for spec in all_ops().values())
    assert report.passed, report.summary()
    assert len(report.results) == expected and {r.status for r in report.results} == {"passed"}
    assert {r.op for r in report.results} == set(all_ops())


def test_wrong_output_fails_with_the_op_and_error_size():
    def off_by_one_percent(x, weight, eps):
        return rms_norm_ref(x, weight, eps) * 1.01

    report = check(backend(rms_norm=off_by_one_percent))
    assert not report.passed and {r.op for r in report.results} == {"rms_norm"}
    failure = report.failures[0]
    assert "outside atol" in failure.message and failure.max_abs_err > 1e-3
    assert "FAILED rms_norm[float32#0]" in report.summary()


def test_error_within_tolerance_passes_and_beyond_fails():
    def noisy(scale):
        def fn(x, weight, eps):
            y = rms_norm_ref(x, weight, eps)
            return y + scale * torch.ones_like(y)

        return fn

    assert check(backend(rms_norm=noisy(1e-7))).passed
    assert not check(backend(rms_norm=noisy(1e-3))).passed
    assert check(backend(rms_norm=noisy(1e-2)), dtypes=(torch.bfloat16,)).passed  # bf16 tolerance 2e-2


def test_integer_outputs_must_match_exactly():
    def swapped_ids(logits, correction_bias, fixed_ids, top_k, scoring, routed_scale):
        weights, ids = get_op("moe_route").reference(
            logits, correction_bias, fixed_ids, top_k, scoring, routed_scale
        )
        return weights, ids.flip(-1)

    report = check(backend(moe_route=swapped_ids))
    assert not report.passed
    assert (
        "output[1]" in report.failures[0].message and "integer elements differ" in report.failures[0].message
    )


def test_wrong_shape_dtype_and_structure_are_reported():
    problems: list[str] = []
    compare(torch.zeros(2, 3), torch.zeros(3, 2), 1e-5, 1e-5, "output", problems)
    compare(torch.zeros(2, dtype=torch.float16), torch.zeros(2), 1e-5, 1e-5, "output", problems)
    compare((torch.zeros(2),), (torch.zeros(2), torch.zeros(1)), 1e-5, 1e-5, "output", problems)
    compare({"a": torch.zeros(1)}, {"b": torch.zeros(1)}, 1e-5, 1e-5, "output", problems)
    assert len(problems) == 4
    assert "(3, 2)" in problems[0] and "float16" in problems[1]
    assert "sequence of 2" in problems[2] and "keys ['b']" in problems[3]


def test_nan_in_both_is_equal_but_nan_in_one_is_not():
    problems: list[str] = []
    nan = torch.tensor([1.0, float("nan")])
    assert compare(nan, nan.clone(), 1e-5, 1e-5, "output", problems) == 0.0 and not problems
    compare(torch.tensor([1.0, 2.0]), nan, 1e-5, 1e-5, "output", problems)
    assert problems


def test_backend_that_raises_fails_with_the_exception():
    def crash(x, weight, eps):
        raise RuntimeError("kernel launch failed")

    report = check(backend(rms_norm=crash))
    assert [r.status for r in report.results] == ["failed", "failed"]
    assert "RuntimeError: kernel launch failed" in report.failures[0].message


def test_cases_rejected_by_supports_are_skipped_when_another_case_runs():
    def weighted_only(x, weight, eps):
        return True if weight is not None else "no unweighted norm"

    report = check(backend(rms_norm=OpImpl(fn=rms_norm_ref, supports=weighted_only)))
    assert report.passed, report.summary()
    assert [r.status for r in report.results] == ["passed", "skipped"]
    assert "no unweighted norm" in report.results[1].message and not report.never_ran


def test_op_whose_every_case_supports_rejects_fails_with_the_reasons():
    impl = OpImpl(fn=lambda x, weight, eps: x * 0, supports=lambda x, weight, eps: "no unweighted norm")
    report = check(backend(rms_norm=impl), dtypes=(torch.float32, torch.bfloat16))
    assert {r.status for r in report.results} == {"skipped"} and not report.failures
    assert not report.passed
    assert report.never_ran == {"rms_norm": ["supports() rejects: no unweighted norm"]}
    assert "FAILED rms_norm: supports() rejected every case" in report.summary()
    assert "no unweighted norm" in report.summary()


def test_a_false_verdict_is_shown_as_what_supports_returned():
    impl = OpImpl(fn=rms_norm_ref, supports=lambda x, weight, eps: False)
    report = check(backend(rms_norm=impl))
    assert not report.passed and "supports() returned False" in report.summary()


def test_supports_that_raises_fails_the_case():
    def broken(x, weight, eps):
        raise ValueError("bad predicate")

    report = check(backend(rms_norm=OpImpl(fn=rms_norm_ref, supports=broken)))
    assert not report.passed and "supports() raised ValueError: bad predicate" in report.failures[0].message


def test_pytest_items_of_an_op_whose_every_case_is_rejected_include_a_failing_one():
    impl = OpImpl(fn=rms_norm_ref, supports=lambda x, weight, eps: "needs a CUDA tensor")
    cases = cases_of(backend(rms_norm=impl))
    assert [str(c) for c in cases] == [
        "under_test-rms_norm-float32-0",
        "under_test-rms_norm-float32-1",
        "under_test-rms_norm-coverage",
    ]
    for case in cases[:2]:
        with pytest.raises(pytest.skip.Exception, match="needs a CUDA tensor"):
            case.check()
    with pytest.raises(AssertionError, match="rejected every case.*needs a CUDA tensor"):
        cases[2].check()


def test_no_coverage_item_when_some_case_runs():
    impl = OpImpl(fn=rms_norm_ref, supports=lambda x, weight, eps: weight is not None)
    assert [str(c) for c in cases_of(backend(rms_norm=impl))] == [
        "under_test-rms_norm-float32-0",
        "under_test-rms_norm-float32-1",
    ]


def wide_rows(g, dtype):
    """A shape the op's own cases miss: rows of 256."""
    return [((randn(g, 3, 256, dtype=dtype), 1 + randn(g, 256, scale=0.1), 1e-6), {})]


def first_64_columns_only(x, weight, eps):
    """A wrong kernel that normalises with the mean square of the first 64 columns only."""
    head = x[..., :64].float()
    y = x.float() * torch.rsqrt(head.square().mean(-1, keepdim=True) + eps)
    return (y * weight.float() if weight is not None else y).to(x.dtype)


def test_backend_supplied_cases_run_in_addition_to_the_ops_own():
    wrong = backend(rms_norm=first_64_columns_only)
    assert check(wrong).passed  # the op's own cases are 64 and 32 wide
    report = check(wrong, cases={"rms_norm": wide_rows}, dtypes=(torch.float32, torch.bfloat16))
    assert not report.passed
    assert [r.label for r in report.failures] == ["float32#own0", "bfloat16#own0"]
    assert "FAILED rms_norm[float32#own0]: output" in report.summary()
    assert sum(r.status == "passed" for r in report.results) == 4  # the op's own cases still ran
    assert check(backend(rms_norm=rms_norm_ref), cases={"rms_norm": wide_rows}).passed


def test_backend_supplied_cases_are_pytest_items_too():
    wrong = backend(rms_norm=first_64_columns_only)
    cases = cases_of(wrong, cases={"rms_norm": wide_rows})
    assert [str(c) for c in cases][-1] == "under_test-rms_norm-float32-own0"
    cases[0].check()
    with pytest.raises(AssertionError, match="under_test-rms_norm-float32-own0: output"):
        cases[-1].check()


def test_kernel_for_its_own_shapes_only_passes_on_the_cases_it_supplies():
    def wide_only(x, weight, eps):
        return True if x.shape[-1] >= 256 else f"width {x.shape[-1]} < 256"

    impl = OpImpl(fn=rms_norm_ref, supports=wide_only)
    assert not check(backend(rms_norm=impl)).passed
    report = check(backend(rms_norm=impl), cases={"rms_norm": wide_rows})
    assert report.passed, report.summary()
    assert [r.status for r in report.results] == ["skipped", "skipped", "passed"]


def test_cases_registered_with_the_op_run_whenever_the_backend_is_checked():
    wrong = backend(rms_norm=OpImpl(fn=first_64_columns_only, sample_cases=wide_rows))
    report = check(wrong)  # no cases= argument: the registration carries them
    assert [r.label for r in report.failures] == ["float32#own0"]
    assert [str(c) for c in cases_of(wrong)][-1] == "under_test-rms_norm-float32-own0"
    right = backend(rms_norm=OpImpl(fn=rms_norm_ref, sample_cases=wide_rows))
    assert check(right).passed


def test_cases_for_an_op_the_backend_does_not_provide_are_an_error():
    with pytest.raises(BackendError, match=r"does not provide: \['linaer'\]"):
        check(backend(rms_norm=rms_norm_ref), cases={"linaer": wide_rows})


@pytest.fixture
def op_without_cases(monkeypatch):
    """A contract op ``double`` with no sample cases (removed after the test)."""

    def double(x: torch.Tensor) -> torch.Tensor:
        """``2 * x``."""
        return 2 * x

    monkeypatch.setitem(registry._OPS, "double", OpSpec("double", "test", double))
    return "double"


def test_op_without_sample_cases_is_untested_and_fails_unless_the_backend_supplies_cases(op_without_cases):
    under_test = backend(double=lambda x: x + x)
    report = check(under_test)
    assert not report.passed and report.untested_ops == ["double"] and not report.results
    assert "UNTESTED double" in report.summary()
    [item] = cases_of(under_test)
    assert str(item) == "under_test-double-coverage"
    with pytest.raises(AssertionError, match="no sample case"):
        item.check()

    def supplied(g, dtype):
        return [((randn(g, 4, dtype=dtype),), {})]

    report = check(under_test, cases={"double": supplied})
    assert report.passed and report.untested_ops == [] and [r.status for r in report.results] == ["passed"]
    assert not check(backend(double=lambda x: 3 * x), cases={"double": supplied}).passed


def test_backend_inputs_are_copies_so_in_place_kernels_cannot_fool_the_reference():
    def in_place(x, weight, eps):
        y = rms_norm_ref(x, weight, eps)
        x.zero_()
        return y

    assert check(backend(rms_norm=in_place)).passed


def test_unavailable_backend_gives_one_skipping_case_with_the_reason():
    absent = BackendSpec(name="absent", device_type="cuda", is_available=lambda: (False, "no frobnicator"))
    [case] = cases_of(absent)
    with pytest.raises(pytest.skip.Exception, match="no frobnicator"):
        case.check()
    with pytest.raises(BackendError, match="'absent'.*no frobnicator"):
        check(absent)


def test_cases_can_be_limited_to_some_ops_and_have_readable_ids():
    cases = conformance_cases(REFERENCE, ops=["rms_norm"], dtypes=(torch.bfloat16,))
    assert [str(c) for c in cases] == [
        "reference_copy-rms_norm-bfloat16-0",
        "reference_copy-rms_norm-bfloat16-1",
    ]


def test_unknown_backend_name_is_a_backend_error():
    with pytest.raises(BackendError, match="unknown backend 'no_such_backend'"):
        check_backend("no_such_backend")


def _plain_weight(w):
    return w.dequantize(torch.float32) if isinstance(w, QuantizedTensor) else w


def test_quantised_weight_cases_catch_a_kernel_that_ignores_the_scales():
    """linear / grouped_linear / moe_experts have QuantizedTensor cases (keep_quantized): a kernel
    that reads the FP8 codes without their block scales fails them, one that dequantises passes."""
    linear_ref = get_op("linear").reference

    def unscaled(x, weight):
        if isinstance(weight, QuantizedTensor):
            return torch.nn.functional.linear(x, weight.data.to(x.dtype))
        return linear_ref(x, weight)

    def dequantising(x, weight):
        return torch.nn.functional.linear(x, _plain_weight(weight).to(x.dtype))

    bad = check(backend(linear=unscaled), dtypes=(torch.float32, torch.bfloat16))
    assert not bad.passed and {r.index for r in bad.failures} == {1, 2}
    assert check(backend(linear=dequantising), dtypes=(torch.float32, torch.bfloat16)).passed


def test_a_kernel_may_leave_quantised_weights_to_the_reference_through_supports():
    def plain_only(x, weight):
        return True if isinstance(weight, torch.Tensor) else "quantised weights are not supported"

    def plain_experts(x, ids, weights, gate_up, down, limit):
        return True if isinstance(gate_up, torch.Tensor) else "FP4 experts are not supported"

    spec = backend(
        linear=OpImpl(get_op("linear").reference, supports=plain_only),
        moe_experts=OpImpl(get_op("moe_experts").reference, supports=plain_experts),
    )
    report = check(spec)
    assert report.passed, report.summary()
    skipped = {(r.op, r.index) for r in report.results if r.status == "skipped"}
    # moe_experts case 1 gives `shared`, which this (older-style) predicate does not take
    assert skipped == {
        ("linear", 1),
        ("linear", 2),
        ("moe_experts", 1),
        ("moe_experts", 2),
        ("moe_experts", 3),
    }


def test_an_implementation_predating_an_optional_argument_gets_the_reference_for_it(caplog):
    """A backend op written before the contract gained an optional argument (``moe_experts``'s
    ``shared``): calls giving it run on the reference (logged once), others on the backend."""
    from deepinfer_core.ops import OpTable

    calls = []
    ref = get_op("moe_experts").reference

    def old_kernel(x, ids, weights, gate_up, down, limit):
        calls.append(x.shape[0])
        return ref(x, ids, weights, gate_up, down, limit)

    table = OpTable({"moe_experts": OpImpl(old_kernel)}, backend="old")
    g = torch.Generator().manual_seed(0)
    x, ids = torch.randn(3, 16, generator=g), torch.tensor([[0, 1], [1, 2], [3, 0]])
    w = torch.rand(3, 2, generator=g)
    gu, dn = torch.randn(4, 16, 16, generator=g) * 0.3, torch.randn(4, 16, 8, generator=g) * 0.3
    shared = torch.randn(3, 16, generator=g)
    with caplog.at_level("WARNING", logger="deepinfer.ops"):
        fused = table.moe_experts(x, ids, w, gu, dn, 10.0, shared=shared)
        plain = table.moe_experts(x, ids, w, gu, dn, 10.0, shared=None)
    assert calls == [3]  # the call with `shared` went to the reference
    assert torch.equal(fused, ref(x, ids, w, gu, dn, 10.0) + shared)
    assert torch.equal(plain, ref(x, ids, w, gu, dn, 10.0))
    assert "takes no ['shared']" in caplog.text
    table.strict = True  # strict_ops: no reference for it
    with pytest.raises(OpNotSupportedError, match="takes no"):
        table.moe_experts(x, ids, w, gu, dn, 10.0, shared=shared)


def test_quantised_weights_reach_the_backend_as_copies():
    def scribbles(x, weight):
        y = get_op("linear").reference(x, weight)
        if isinstance(weight, QuantizedTensor):
            weight.scale.zero_()
        return y

    assert check(backend(linear=scribbles)).passed


def test_an_op_the_backend_defines_while_its_ops_load_is_in_the_contract(monkeypatch):
    """A backend may import the module that defines an extension op while it loads its ops (as
    ``cuda_sm100`` imports V4.1's ops when TileKernels serves one of them): the check takes the
    contract after loading them, so the op is checked, not refused as unknown."""
    from deepinfer_core.ops import registry

    monkeypatch.setattr(registry, "_OPS", dict(registry.all_ops()))

    def double(x: torch.Tensor) -> torch.Tensor:
        """``2 x``."""
        return 2 * x

    double.__module__ = "vendor_plugin.ops"

    def cases(g, dtype):
        return [((torch.randn(4, 3, generator=g).to(dtype),), {})]

    def load():
        registry.define_op("vendor.double", "vendor", sample_cases=cases)(double)
        return {"vendor.double": OpImpl(fn=lambda x: x + x)}

    spec = BackendSpec(name="late_ops", device_type="cpu", ops=load)
    report = check(spec)
    assert report.passed, report.summary()
    assert {r.op for r in report.results} == {"vendor.double"}


def test_fused_ops_left_to_their_decomposition_are_checked_on_the_backends_parts():
    def off_by_one_percent(x, weight, eps):
        return rms_norm_ref(x, weight, eps) * 1.01

    decomposed = {name for name, op in all_ops().items() if op.decomposition is not None}
    assert {"hc_post_pre", "compress_windows"} <= decomposed
    ids = [str(c) for c in conformance_cases(backend(rms_norm=rms_norm_ref))]
    assert "under_test-hc_post_pre-float32-0" in ids and "under_test-compress_windows-float32-0" in ids
    assert check_backend(backend(rms_norm=rms_norm_ref)).passed
    # the wrong rms_norm also breaks the fused op whose last part it is, run as the engine would
    report = check_backend(backend(rms_norm=off_by_one_percent))
    assert {r.op for r in report.failures} == {"rms_norm", "hc_post_pre", "qk_norm_rope", "hc_head_norm"}
    assert {r.op for r in report.results} == {"rms_norm"} | decomposed
