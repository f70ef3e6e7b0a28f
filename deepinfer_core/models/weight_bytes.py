"""Weight memory accounting shared by the model families: every storage a model's weights use,
counted once (fused projections and aliases share storages), split into plain and quantised."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from deepinfer_core.weights.quant import QuantizedTensor


def weight_storages(roots: Iterable[object], skip: tuple[type, ...] = ()) -> dict[int, tuple[int, bool]]:
    """``{data_ptr: (bytes, quantised)}`` of every tensor storage reachable from ``roots``
    through dicts, lists, tuples and object attributes (objects of the ``skip`` types and
    classes are not entered); quantised storages are the data and scales of
    :class:`~deepinfer_core.weights.quant.QuantizedTensor` weights."""
    seen: dict[int, tuple[int, bool]] = {}
    stack: list[tuple[object, bool]] = [(r, False) for r in roots]
    while stack:
        obj, quantized = stack.pop()
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            seen[st.data_ptr()] = (st.nbytes(), quantized)
        elif isinstance(obj, QuantizedTensor):
            stack += [(obj.data, True), (obj.scale, True)]
        elif isinstance(obj, dict):
            stack.extend((v, quantized) for v in obj.values())
        elif isinstance(obj, list | tuple):
            stack.extend((v, quantized) for v in obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (*skip, type)):
            stack.extend((v, quantized) for v in vars(obj).values())
    return seen


def weight_bytes(storages: dict[int, tuple[int, bool]], quantized_only: bool = False) -> int:
    """Total bytes of :func:`weight_storages`' result (only the quantised ones if asked)."""
    return sum(n for n, q in storages.values() if q or not quantized_only)
