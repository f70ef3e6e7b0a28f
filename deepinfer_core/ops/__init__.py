"""The op contract (see :mod:`deepinfer_core.ops.registry`) and its reference implementations.

One module per family; importing :mod:`deepinfer_core.ops._load_all` registers them all.
"""

from .registry import OpImpl, OpSpec, all_ops, define_op, get_op
from .table import OpTable

__all__ = ["OpImpl", "OpSpec", "OpTable", "all_ops", "define_op", "get_op"]
