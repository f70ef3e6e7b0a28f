"""Recording the host syncs a piece of code would make on an accelerator, on any device.

A CPU run cannot observe a sync, but it can see every op that forces one on CUDA: reading a
value (``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``, ``.numpy()``), ops whose output
shape depends on the values (``nonzero``, boolean-mask indexing, ``masked_select``,
``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``) and value
comparisons returning a Python bool (``equal``).  :class:`HostSyncRecorder` watches both
levels: ``__torch_function__`` for the Python-level reads (``.tolist()`` on a CPU tensor never
reaches the dispatcher) and ``__torch_dispatch__`` for the aten ops, including those that
composite functions decompose into.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# aten ops that read a value on the host, or size their output by the values (on CUDA: a sync)
SYNC_OPS = {
    aten._local_scalar_dense,
    aten.item,
    aten.is_nonzero,
    aten.nonzero,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.bincount,
    aten.histc,
    aten.equal,
}
# Python-level reads of a tensor's values
SYNC_METHODS = {"tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__", "__complex__"}
_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _is_mask_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


def syncing_op(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the aten op ``func(*args, **kwargs)`` would make a host sync on CUDA."""
    packet = func.overloadpacket
    if packet in SYNC_OPS:
        return True
    if packet is aten.repeat_interleave and func is not aten.repeat_interleave.self_int:
        return kwargs.get("output_size") is None
    if packet in _INDEX_OPS:
        return _is_mask_index(args[1] if len(args) > 1 else kwargs.get("indices"))
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if syncing_op(func, args, kwargs):
            self.found.append(str(func))
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS:
            self.found.append(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


@contextmanager
def record_host_syncs() -> Iterator[list[str]]:
    """Collect (into the yielded list) every op run in the scope that would sync on CUDA."""
    found: list[str] = []
    with _Function(found), _Dispatch(found):
        yield found
