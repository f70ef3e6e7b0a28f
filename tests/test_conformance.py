"""The conformance suite: it passes correct backends and catches wrong ones."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends import BackendSpec
from deepinfer_core.errors import BackendError
from deepinfer_core.ops import OpImpl, all_ops, get_op
from deepinfer_core.testing import check_backend, conformance_cases
from deepinfer_core.testing.conformance import compare

REFERENCE = BackendSpec(
    name="reference_copy",
    device_type="cpu",
    ops=lambda: {name: OpImpl(fn=spec.reference) for name, spec in all_ops().items()},
)


def backend(**ops) -> BackendSpec:
    return BackendSpec(name="under_test", device_type="cpu", ops=ops)


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

    report = check_backend(backend(rms_norm=off_by_one_percent))
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

    assert check_backend(backend(rms_norm=noisy(1e-7))).passed
    assert not check_backend(backend(rms_norm=noisy(1e-3))).passed
    assert check_backend(
        backend(rms_norm=noisy(1e-2)), dtypes=(torch.bfloat16,)
    ).passed  # bf16 tolerance 2e-2


def test_integer_outputs_must_match_exactly():
    def swapped_ids(logits, correction_bias, fixed_ids, top_k, scoring, routed_scale):
        weights, ids = get_op("moe_route").reference(
            logits, correction_bias, fixed_ids, top_k, scoring, routed_scale
        )
        return weights, ids.flip(-1)

    report = check_backend(backend(moe_route=swapped_ids))
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

    report = check_backend(backend(rms_norm=crash))
    assert [r.status for r in report.results] == ["failed", "failed"]
    assert "RuntimeError: kernel launch failed" in report.failures[0].message


def test_cases_rejected_by_supports_are_skipped_not_failed():
    impl = OpImpl(fn=lambda x, weight, eps: x * 0, supports=lambda x, weight, eps: "no unweighted norm")
    report = check_backend(backend(rms_norm=impl))
    assert report.passed and {r.status for r in report.results} == {"skipped"}
    assert "no unweighted norm" in report.results[0].message


def test_backend_inputs_are_copies_so_in_place_kernels_cannot_fool_the_reference():
    def in_place(x, weight, eps):
        y = rms_norm_ref(x, weight, eps)
        x.zero_()
        return y

    assert check_backend(backend(rms_norm=in_place)).passed


def test_unavailable_backend_gives_one_skipping_case_with_the_reason():
    absent = BackendSpec(name="absent", device_type="cuda", is_available=lambda: (False, "no frobnicator"))
    [case] = conformance_cases(absent)
    with pytest.raises(pytest.skip.Exception, match="no frobnicator"):
        case.check()
    with pytest.raises(BackendError, match="'absent'.*no frobnicator"):
        check_backend(absent)


def test_cases_can_be_limited_to_some_ops_and_have_readable_ids():
    cases = conformance_cases(REFERENCE, ops=["rms_norm"], dtypes=(torch.bfloat16,))
    assert [str(c) for c in cases] == [
        "reference_copy-rms_norm-bfloat16-0",
        "reference_copy-rms_norm-bfloat16-1",
    ]


def test_unknown_backend_name_is_a_backend_error():
    with pytest.raises(BackendError, match="unknown backend 'no_such_backend'"):
        check_backend("no_such_backend")
