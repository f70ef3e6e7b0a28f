"""BackendSpec validation and lazy ops, and backend resolution (auto, names, strict_ops)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from deepinfer_core.backends import BackendSpec, resolve_backend
from deepinfer_core.errors import BackendError, OpNotSupportedError, PluginError
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.ops import OpImpl, get_op
from deepinfer_core.plugins import PluginManager
from deepinfer_core.testing import core_only_manager


def manager_with(*plugins: tuple[str, list[BackendSpec]]) -> PluginManager:
    """The core plus one plugin per ``(name, backends)``."""
    manager = core_only_manager()  # no installed plugins: the core only
    for name, specs in plugins:
        module = types.ModuleType(name)
        module.DEEPINFER_API = ">=1.0,<2"

        def deepinfer_register_backends(register, specs=specs):
            for spec in specs:
                register(spec)

        module.deepinfer_register_backends = hookimpl(deepinfer_register_backends)
        assert manager.add_plugin(module, name).status == "loaded"
    return manager


def cpu(name: str, priority: int = 10, reason: str | None = None, ops=None) -> BackendSpec:
    probe = (lambda: (True, None)) if reason is None else (lambda: (False, reason))
    return BackendSpec(name=name, device_type="cpu", priority=priority, is_available=probe, ops=ops or {})


@pytest.mark.parametrize(
    ("kwargs", "culprit"),
    [
        ({"name": "", "device_type": "cpu"}, "backend name"),
        ({"name": "has space", "device_type": "cpu"}, "'has space'"),
        ({"name": "x", "device_type": ""}, "device_type"),
        ({"name": "x", "device_type": "cpu", "priority": "high"}, "priority"),
        ({"name": "x", "device_type": "cpu", "is_available": True}, "is_available"),
    ],
)
def test_invalid_backend_spec_is_a_plugin_error_naming_the_field(kwargs, culprit):
    with pytest.raises(PluginError, match=culprit):
        BackendSpec(**kwargs)


def test_availability_probe_that_raises_counts_as_unavailable_with_the_error():
    def probe():
        raise OSError("libcuda.so not found")

    ok, reason = BackendSpec(name="x", device_type="cuda", is_available=probe).availability()
    assert not ok and "OSError" in reason and "libcuda.so" in reason


def test_unavailable_without_reason_gets_one():
    ok, reason = BackendSpec(name="x", device_type="cuda", is_available=lambda: (False, None)).availability()
    assert not ok and reason


def test_ops_callable_is_called_lazily_once_and_plain_functions_are_wrapped():
    calls = []

    def load():
        calls.append(1)
        return {"rms_norm": get_op("rms_norm").reference}

    spec = BackendSpec(name="lazy", device_type="cpu", ops=load)
    assert calls == []
    ops = spec.load_ops()
    assert spec.load_ops() == ops and calls == [1]
    assert isinstance(ops["rms_norm"], OpImpl) and ops["rms_norm"].supports is None


def test_ops_callable_that_fails_is_a_backend_error_naming_the_backend():
    def load():
        raise ImportError("no module named 'triton'")

    with pytest.raises(BackendError, match=r"'broken'.*triton"):
        BackendSpec(name="broken", device_type="cpu", ops=load).load_ops()


def test_reference_resolves_to_the_core_backend_with_reference_ops():
    spec, ops = resolve_backend("reference", strict_ops=True, plugins=manager_with())
    assert spec.plugin == "core" and spec.device_type == "cpu"
    assert ops.rms_norm is get_op("rms_norm").reference
    assert set(ops.sources.values()) == {"backend"}


def test_unknown_backend_lists_the_known_ones():
    manager = manager_with(("vendor", [cpu("fastcpu")]))
    with pytest.raises(BackendError, match=r"unknown backend 'nope'.*'auto'.*'fastcpu'.*'reference'"):
        resolve_backend("nope", plugins=manager)


def test_unavailable_backend_is_refused_with_the_probe_reason():
    manager = manager_with(("vendor", [cpu("gpu", reason="no frobnicator attached")]))
    with pytest.raises(BackendError, match=r"'gpu' .*not available: no frobnicator attached"):
        resolve_backend("gpu", plugins=manager)


def test_auto_picks_the_available_backend_of_highest_priority(caplog):
    manager = manager_with(
        ("a", [cpu("mid", priority=10)]),
        ("b", [cpu("high_absent", priority=100, reason="no device")]),
        ("c", [cpu("low", priority=5)]),
    )
    with caplog.at_level(logging.INFO, logger="deepinfer.backends"):
        spec, _ = resolve_backend("auto", plugins=manager)
    assert spec.name == "mid"
    assert any("using backend 'mid'" in r.getMessage() for r in caplog.records)
    assert any("high_absent: no device" in r.getMessage() for r in caplog.records)


def test_auto_falls_back_to_reference_when_no_hardware_backend_is_available():
    manager = manager_with(("gpu", [cpu("gpu", priority=100, reason="no GPU")]))
    spec, _ = resolve_backend("auto", plugins=manager)
    assert spec.name == "reference"


def test_auto_refuses_two_third_party_backends_sharing_the_top_priority():
    manager = manager_with(("vendor_a", [cpu("a_gpu", 100)]), ("vendor_b", [cpu("b_gpu", 100)]))
    with pytest.raises(
        BackendError, match=r"ambiguous.*'a_gpu' \(plugin 'vendor_a'\).*'b_gpu' \(plugin 'vendor_b'\)"
    ):
        resolve_backend("auto", plugins=manager)
    spec, _ = resolve_backend("b_gpu", plugins=manager)  # naming one explicitly works
    assert spec.name == "b_gpu"


def test_auto_prefers_a_third_party_backend_tied_with_the_reference():
    manager = manager_with(("vendor", [cpu("zero", priority=0)]))
    spec, _ = resolve_backend("auto", plugins=manager)
    assert spec.name == "zero"


def test_missing_ops_fall_back_to_reference_with_one_warning_naming_them(caplog):
    impl = OpImpl(fn=get_op("rms_norm").reference)
    manager = manager_with(("vendor", [cpu("partial", ops={"rms_norm": impl})]))
    with caplog.at_level(logging.WARNING, logger="deepinfer.ops"):
        spec, ops = resolve_backend("partial", strict_ops=False, plugins=manager)
    assert ops.sources["rms_norm"] == "backend" and ops.sources["linear"] == "reference"
    assert ops.linear is get_op("linear").reference
    [record] = [r for r in caplog.records if r.name == "deepinfer.ops"]
    assert "'partial'" in record.getMessage() and "'linear'" in record.getMessage()


def test_strict_ops_refuses_a_backend_missing_ops():
    impl = OpImpl(fn=get_op("rms_norm").reference)
    manager = manager_with(("vendor", [cpu("partial", ops={"rms_norm": impl})]))
    with pytest.raises(OpNotSupportedError, match=r"'partial'.*strict_ops"):
        resolve_backend("partial", strict_ops=True, plugins=manager)


def test_supports_predicate_routes_rejected_cases_to_the_reference():
    calls = []

    def fast(x, weight, eps):
        calls.append(x.dtype)
        return get_op("rms_norm").reference(x, weight, eps)

    impl = OpImpl(fn=fast, supports=lambda x, weight, eps: x.dtype == torch.float32 or "fp32 only")
    manager = manager_with(("vendor", [cpu("picky", ops={"rms_norm": impl})]))
    _, ops = resolve_backend("picky", plugins=manager)
    ops.rms_norm(torch.ones(2, 4), None, 1e-6)
    ops.rms_norm(torch.ones(2, 4, dtype=torch.bfloat16), None, 1e-6)
    assert calls == [torch.float32]


def _every_op_but(*left_out: str) -> dict[str, OpImpl]:
    from deepinfer_core.ops import all_ops

    return {
        n: OpImpl(fn=spec.reference) for n, spec in all_ops().items() if n not in left_out and "." not in n
    }


def test_a_fused_op_left_out_runs_its_decomposition_on_the_backends_parts_even_under_strict_ops(caplog):
    calls = []

    def norm(x, weight, eps):
        calls.append("rms_norm")
        return get_op("rms_norm").reference(x, weight, eps)

    impls = _every_op_but("hc_head_norm") | {"rms_norm": OpImpl(fn=norm)}
    manager = manager_with(("vendor", [cpu("parts", ops=impls)]))
    with caplog.at_level(logging.WARNING, logger="deepinfer.ops"):
        _, ops = resolve_backend("parts", strict_ops=True, plugins=manager)  # not a missing op
    assert ops.sources["hc_head_norm"] == "decomposed" and not caplog.records
    args, kwargs = get_op("hc_head_norm").sample_cases(torch.Generator().manual_seed(0), torch.float32)[0]
    assert torch.equal(ops.hc_head_norm(*args, **kwargs), get_op("hc_head_norm").reference(*args, **kwargs))
    assert calls == ["rms_norm"]  # the backend's own part ran


def test_a_fused_op_rejecting_a_case_runs_its_decomposition_logged_once(caplog):
    calls = []

    def fused(*args):
        calls.append("fused")
        return get_op("hc_head_norm").reference(*args)

    impl = OpImpl(fn=fused, supports=lambda *args: args[-1] is not None or "unweighted norms go apart")
    manager = manager_with(("vendor", [cpu("fusing", ops=_every_op_but() | {"hc_head_norm": impl})]))
    _, ops = resolve_backend("fusing", strict_ops=True, plugins=manager)
    cases = get_op("hc_head_norm").sample_cases(torch.Generator().manual_seed(0), torch.float32)
    (weighted, _), (unweighted, _) = cases
    with caplog.at_level(logging.WARNING, logger="deepinfer.ops"):
        for args in (weighted, unweighted, unweighted):
            assert torch.equal(ops.hc_head_norm(*args), get_op("hc_head_norm").reference(*args))
    assert calls == ["fused"]  # strict_ops allows the decomposition: its parts are checked
    [record] = caplog.records
    assert "decomposition" in record.getMessage() and "unweighted norms go apart" in record.getMessage()


def test_backend_providing_an_op_outside_the_contract_is_refused():
    manager = manager_with(("vendor", [cpu("odd", ops={"not_an_op": lambda: None})]))
    with pytest.raises(OpNotSupportedError, match="not_an_op"):
        resolve_backend("odd", plugins=manager)


@pytest.fixture
def extension_op(monkeypatch):
    """A plugin-defined op ``vendor.scaled_add`` with its reference (registry restored after)."""
    from deepinfer_core.ops import registry

    monkeypatch.setattr(registry, "_OPS", dict(registry.all_ops()))

    def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
        """``x + alpha * y``."""
        return x + alpha * y

    scaled_add.__module__ = "vendor_plugin.ops"

    def cases(g, dtype):
        return [
            ((torch.randn(3, 5, generator=g).to(dtype), torch.randn(3, 5, generator=g).to(dtype), 0.5), {})
        ]

    registry.define_op("vendor.scaled_add", "vendor", sample_cases=cases)(scaled_add)
    return "vendor.scaled_add"


def test_extension_op_resolves_like_a_core_op_and_is_checked_by_conformance(extension_op, caplog):
    from deepinfer_core.testing import check_backend

    kernel = OpImpl(fn=lambda x, y, alpha: torch.add(x, y, alpha=alpha))
    manager = manager_with(("vendor", [cpu("ext", ops={extension_op: kernel})]))
    with caplog.at_level(logging.WARNING, logger="deepinfer.ops"):
        _, ops = resolve_backend("ext", plugins=manager)
    assert ops[extension_op] is kernel.fn and ops.sources[extension_op] == "backend"
    assert all(extension_op not in r.getMessage() for r in caplog.records)  # not "missing" elsewhere
    _, reference = resolve_backend("reference", plugins=manager)
    assert reference[extension_op] is get_op(extension_op).reference
    assert check_backend(manager.get_backend("ext"), ops=[extension_op]).passed
    wrong = cpu("wrong", ops={extension_op: OpImpl(fn=lambda x, y, alpha: x - alpha * y)})
    assert not check_backend(wrong, ops=[extension_op]).passed
    with pytest.raises(KeyError, match="no op 'vendor.nope'"):
        ops["vendor.nope"]


def test_extension_ops_need_a_namespace_and_core_ops_must_not_have_one():
    from deepinfer_core.ops import define_op

    def plain(x):
        return x

    plain.__module__ = "vendor_plugin.ops"
    with pytest.raises(ValueError, match="namespaced name"):
        define_op("plain", "vendor")(plain)
