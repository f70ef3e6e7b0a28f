"""The core's own registrations, made through the same hooks as any third-party plugin.

- backend ``reference``: the pure-PyTorch reference implementation of every op; runs on any
  device torch supports, lowest priority (0) so that ``backend="auto"`` prefers any available
  hardware backend.
- drafters ``ngram`` (prompt lookup decoding, no weights), ``mtp`` (DeepSeek-V4's
  multi-token-prediction layer) and ``dspark`` (DeepSeek-V4.1's DSpark block drafter) for
  speculative decoding, and its verify-length policies ``fixed`` and ``dspark``.
- model types ``deepseek_v4`` and ``deepseek_v41``: the
  :class:`~deepinfer_core.models.registry.ModelFamily` of
  :mod:`deepinfer_core.models.deepseek_v4.family` and
  :mod:`deepinfer_core.models.deepseek_v41.family`, imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from deepinfer_core.backends.base import BackendSpec
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.ops.registry import OpImpl, all_ops

if TYPE_CHECKING:
    from deepinfer_core.models.registry import ModelFamily

DEEPINFER_API = ">=1.0,<2"


def _reference_ops() -> dict[str, OpImpl]:
    """Every op of the contract, implemented by its reference."""
    return {name: OpImpl(fn=spec.reference) for name, spec in all_ops().items()}


def _deepseek_v4() -> ModelFamily:
    """The DeepSeek-V4 model family, imported on first use."""
    return importlib.import_module("deepinfer_core.models.deepseek_v4.family").FAMILY


def _deepseek_v41() -> ModelFamily:
    """The DeepSeek-V4.1 model family, imported on first use."""
    return importlib.import_module("deepinfer_core.models.deepseek_v41.family").FAMILY


@hookimpl
def deepinfer_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Register the ``reference`` backend."""
    register(
        BackendSpec(
            name="reference",
            device_type="cpu",
            priority=0,
            ops=_reference_ops,
            supports_graph_capture=True,  # every reference op is free of host syncs
            # measured: bitwise on CPU; on CUDA the GEMMs pick kernels by batch shape
            batch_invariant_devices=("cpu",),
            description="pure-PyTorch reference implementation of every op (any device torch supports)",
        )
    )


@hookimpl
def deepinfer_register_models(register: Callable[..., None]) -> None:
    """Register the DeepSeek-V4 and DeepSeek-V4.1 architectures."""
    register(
        "deepseek_v4",
        _deepseek_v4,
        description="DeepSeek-V4 (hybrid sliding-window/compressed attention, MoE)",
    )
    register(
        "deepseek_v41",
        _deepseek_v41,
        description="DeepSeek-V4.1 text (causal encoder-decoder, Engram; DSpark drafter 'dspark')",
    )


def _fcfs() -> type:
    from deepinfer_core.engine.scheduler import Scheduler

    return Scheduler


@hookimpl
def deepinfer_register_schedulers(register: Callable[..., None]) -> None:
    """Register the core's first-come-first-served scheduler (``scheduler="fcfs"``)."""
    register("fcfs", _fcfs, description="first come, first served; preempts the newest running request")


def _ngram() -> type:
    from deepinfer_core.speculative.ngram import NgramDrafter

    return NgramDrafter


def _mtp() -> type:
    from deepinfer_core.speculative.mtp import MtpDrafter

    return MtpDrafter


def _dspark() -> type:
    from deepinfer_core.speculative.dspark import DSparkDrafter

    return DSparkDrafter


@hookimpl
def deepinfer_register_drafters(register: Callable[..., None]) -> None:
    """Register the core's ``ngram`` drafter (prompt lookup decoding, no weights), ``mtp``
    drafter (DeepSeek-V4's multi-token-prediction layer) and ``dspark`` drafter (DeepSeek-V4.1's
    DSpark block drafter)."""
    register(
        "ngram",
        _ngram,
        description="prompt lookup: proposes what followed the last match of the suffix n-gram",
    )
    register(
        "mtp",
        _mtp,
        description="the checkpoint's multi-token-prediction layer (num_nextn_predict_layers, mtp.* tensors)",
    )
    register(
        "dspark",
        _dspark,
        description="DeepSeek-V4.1's DSpark block drafter: draft layers, Markov and confidence heads (mtp.*)",
    )


def _fixed_policy() -> type:
    from deepinfer_core.speculative.verify_policy import FixedPolicy

    return FixedPolicy


def _dspark_policy() -> type:
    from deepinfer_core.speculative.verify_policy import DSparkPolicy

    return DSparkPolicy


@hookimpl
def deepinfer_register_verify_policies(register: Callable[..., None]) -> None:
    """Register the core's verify-length policies ``fixed`` (every draft) and ``dspark``
    (confidence-scheduled against the measured step cost)."""
    register("fixed", _fixed_policy, description="verify every draft the drafter proposed")
    register(
        "dspark",
        _dspark_policy,
        description="per request the length of best expected accepted tokens per unit of measured step cost",
    )
