"""What a backend is: a named set of op implementations for one device type.

Backends are registered by plugins through the ``deepinfer_register_backends`` hook (see
:mod:`deepinfer_core.hookspecs`) and chosen by :func:`deepinfer_core.backends.resolve_backend`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.errors import BackendError, PluginError
from deepinfer_core.ops.kv_registry import check_substitutes
from deepinfer_core.ops.registry import OpImpl
from deepinfer_core.weights.quant import QUANTIZED_FORMATS

OpsMapping = Mapping[str, OpImpl | Callable[..., Any]]
Availability = tuple[bool, str | None]

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


def always_available() -> Availability:
    """Availability probe of a backend that runs everywhere."""
    return True, None


@dataclass(frozen=True)
class BackendSpec:
    """A backend registered by a plugin.

    Attributes:
        name: unique backend name, selected with ``backend="name"`` / ``--backend name``.
        device_type: torch device type the kernels run on (``"cpu"``, ``"cuda"``, ``"npu"``...).
        priority: ``backend="auto"`` picks the available backend with the highest priority;
            the core's ``reference`` backend has priority 0.
        ops: the op implementations by op name (:class:`OpImpl`, or a plain callable with
            the reference signature), or a zero-argument callable returning that mapping so
            that kernel modules are imported only when the backend is used.
        is_available: zero-argument probe returning ``(True, None)`` or ``(False, reason)``;
            the reason says what is missing and how to get it.  It must not raise when the
            hardware or its libraries are absent.
        supports_graph_capture: whether the ops may be captured in device graphs (no host
            syncs, shapes from arguments only); the engine then captures decode steps on
            devices with a graph runtime unless ``enforce_eager``.
        graph_runtime: the device-graph implementation of the backend's device, for a device
            type the core has none for: ``graph_runtime(device)`` returns ``(factory, shared
            memory pool, reason)`` like :func:`~deepinfer_core.engine.graphs.device_graph_factory`
            (``factory(pool)`` makes one graph with ``capture(fn)`` / ``replay()``; ``None`` and
            the reason where none runs here).  ``None``: the core's (CUDA graphs on ``cuda``).
        compiles_kernels: whether the ops compile kernels at their first call for each static
            configuration (Triton, TileLang): the engine then runs warm-up steps at build
            (:meth:`~deepinfer_core.engine.model_runner.ModelRunner.warm_up`: one decode token,
            a full decode batch, a full step of tokens), eager ones included, so that no request
            and no timed step pays a compilation.
        batch_invariant_devices: device types on which the ops honour batch-invariant mode
            (a row's result bitwise independent of the batch); ``batch_invariant=True`` on
            any other device is refused at start-up rather than silently not held.
        quantized_weights: the checkpoint weight formats whose ops the backend implements
            natively, from :data:`~deepinfer_core.weights.quant.QUANTIZED_FORMATS`:
            ``"fp8_block"`` (``linear`` / ``grouped_linear`` take FP8 e4m3 weights with
            128x128 block scales) and ``"fp4_experts"`` (``moe_experts`` takes FP4 e2m1 expert
            stacks with one scale per 32 inputs).  With the engine option ``keep_quantized``
            left at ``None`` the weights of these formats stay quantised in device memory and
            reach the ops as :class:`~deepinfer_core.weights.quant.QuantizedTensor`; the others
            are dequantised at load.  Empty (the reference's): everything is dequantised at
            load unless ``keep_quantized=True``.
        kv_formats: packed KV formats the backend's ops read in place of the core's, by
            ``kv_format`` name (:data:`~deepinfer_core.ops.kv_registry.PACKED_KV_FORMATS`):
            ``{"fp8": "fp8_tile128"}`` stores the caches a model packs as ``fp8`` in the
            per-tile rows of :class:`~deepinfer_core.ops.kv_tile.TileFp8KVPool` instead of
            :class:`~deepinfer_core.ops.kv_format.Fp8KVPool`.  The engine allocates the cache
            in the substitute (:func:`~deepinfer_core.models.cache_spec.with_kv_formats`), so
            every op, the reference's included, reads and writes that format.  Empty: the
            model's formats.
        description: one line shown by ``deepinfer plugins``.
        plugin: name of the plugin that registered the backend (filled in by the core).
    """

    name: str
    device_type: str
    priority: int = 0
    ops: OpsMapping | Callable[[], OpsMapping] = field(default_factory=dict)
    is_available: Callable[[], Availability] = always_available
    supports_graph_capture: bool = False
    graph_runtime: Callable[[Any], tuple[Any, Any, str]] | None = field(default=None, compare=False)
    compiles_kernels: bool = False
    batch_invariant_devices: tuple[str, ...] = ()
    quantized_weights: tuple[str, ...] = ()
    kv_formats: Mapping[str, str] = field(default_factory=dict, hash=False)
    description: str = ""
    plugin: str | None = None
    _ops_cache: dict[str, OpImpl] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise PluginError(
                f"invalid backend name {self.name!r}: use letters, digits, '_', '-' or '.', "
                "starting with a letter"
            )
        if not isinstance(self.device_type, str) or not self.device_type:
            raise PluginError(f"backend {self.name!r}: device_type must be a non-empty string like 'cuda'")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise PluginError(f"backend {self.name!r}: priority must be an int, got {self.priority!r}")
        if not callable(self.is_available):
            raise PluginError(f"backend {self.name!r}: is_available must be a zero-argument callable")
        if self.graph_runtime is not None and not callable(self.graph_runtime):
            raise PluginError(f"backend {self.name!r}: graph_runtime must be a callable taking the device")
        formats = self.quantized_weights
        if not isinstance(formats, tuple) or not all(isinstance(f, str) for f in formats):
            raise PluginError(
                f"backend {self.name!r}: quantized_weights must be a tuple of format names, got {formats!r}"
            )
        unknown = sorted(set(formats) - set(QUANTIZED_FORMATS))
        if unknown:
            raise PluginError(
                f"backend {self.name!r}: unknown quantized_weights formats {unknown}; known formats: "
                f"{list(QUANTIZED_FORMATS)}"
            )
        problem = check_substitutes(self.kv_formats)
        if problem is not None:
            raise PluginError(f"backend {self.name!r}: kv_formats {problem}")

    def availability(self) -> Availability:
        """Run the availability probe; a probe that raises counts as unavailable with its error."""
        try:
            result = self.is_available()
        except Exception as exc:  # a probe must explain, not crash the engine
            return False, f"availability probe raised {type(exc).__name__}: {exc}"
        if not (isinstance(result, tuple) and len(result) == 2):
            return False, f"availability probe returned {result!r}, expected (bool, reason or None)"
        available, reason = result
        if not available and not reason:
            reason = "the availability probe gave no reason"
        return bool(available), (None if available else str(reason))

    def load_ops(self) -> dict[str, OpImpl]:
        """The op implementations, imported on first call and cached.

        Raises:
            BackendError: the ops callable failed (e.g. a kernel module did not import) or
                returned something other than a mapping of op names to implementations.
        """
        if self._ops_cache:
            return dict(self._ops_cache)
        raw = self.ops
        if callable(raw) and not isinstance(raw, Mapping):
            try:
                raw = raw()
            except Exception as exc:
                raise BackendError(
                    f"backend {self.name!r} (plugin {self.plugin!r}) failed to load its ops: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        if not isinstance(raw, Mapping):
            raise BackendError(
                f"backend {self.name!r} (plugin {self.plugin!r}): ops must be a mapping of op name to "
                f"OpImpl, got {type(raw).__name__}"
            )
        impls: dict[str, OpImpl] = {}
        for op_name, impl in raw.items():
            if isinstance(impl, OpImpl):
                impls[op_name] = impl
            elif callable(impl):
                impls[op_name] = OpImpl(fn=impl)
            else:
                raise BackendError(
                    f"backend {self.name!r} (plugin {self.plugin!r}): op {op_name!r} must be an OpImpl "
                    f"or a callable, got {type(impl).__name__}"
                )
        self._ops_cache.update(impls)
        return impls
