"""Model families: the interface between the engine and an architecture.

An architecture is a plugin of the core.  A plugin registers it by ``model_type`` (the field
of the checkpoint's ``config.json``) through the ``deepinfer_register_models`` hook, with a
zero-argument factory returning a :class:`ModelFamily`::

    @hookimpl
    def deepinfer_register_models(register):
        register("my_arch", lambda: MY_FAMILY, description="...")

The engine reads ``config.json``, resolves the family of its ``model_type``
(:func:`resolve_family`) and uses only this interface: the family parses the config
(:class:`ModelConfig`), loads the weights and builds the model (:class:`Model`), and states
the cache geometry the scheduler needs (compress ratios, replay tail).  The core's own
``deepseek_v4`` family is :data:`deepinfer_core.models.deepseek_v4.family.FAMILY`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from deepinfer_core.contract.step_inputs import StepInputs
from deepinfer_core.errors import ConfigError, PluginError
from deepinfer_core.models.cache_spec import CacheSpec, HybridCache
from deepinfer_core.ops import OpTable
from deepinfer_core.plugins import get_plugins
from deepinfer_core.plugins.lookup import ComponentLookup

DEFAULT_MODEL_TYPE = "deepseek_v4"
"""The family whose built-in model the engine runs when no model is given."""

PLUGIN_HINT = "a plugin registering it through the deepinfer_register_models hook would add it"


class ModelConfig(Protocol):
    """What the engine reads from a parsed model config (anything else is the family's own)."""

    model_type: str
    vocab_size: int
    max_position_embeddings: int

    @property
    def eos_token_ids(self) -> list[int]:
        """The EOS ids of ``config.json`` (the tokenizer's are added by the engine)."""
        ...


class Model(Protocol):
    """What the model runner calls on a built model."""

    def cache_specs(self, kv_cache_dtype: str = "auto", num_spec_tokens: int = 0) -> list[list[CacheSpec]]:
        """Per layer, the caches it keeps between steps (:mod:`~deepinfer_core.models.cache_spec`).

        ``num_spec_tokens`` (``S``): the most draft tokens of a speculative verify step (0
        without speculation).  The engine rolls a verify step back by position alone -- it
        accepts positions ``p..p+a`` of the chunk ``p..p+k`` (``k <= S``) and runs the next
        step from ``p+a+1`` -- so the per-sequence state must be sized such that nothing the
        rejected positions write is read before it is rewritten (V4: ``S`` spare ring rows,
        ``1 + ceil(S/r)`` compressor windows per slot).
        """
        ...

    def step_metadata(
        self, inputs: StepInputs, page_size: int, num_slots: int, trash_page: int, num_spec_tokens: int = 0
    ) -> Any:
        """The step's per-token plans, derived on the device from ``inputs`` (graph-capturable);
        ``num_spec_tokens`` is the value :meth:`cache_specs` was given."""
        ...

    def forward(self, md: Any, cache: HybridCache) -> torch.Tensor:
        """Run one step; float32 logits of the sampling rows.

        A model whose hidden states a drafter's layers read (a
        :class:`~deepinfer_core.speculative.draft_model.DraftModel` with ``taps_hidden``) also
        takes ``hidden_out``: a persistent ``[rows, *hidden_shape]`` buffer that receives every
        row's hidden state (for V4 the last layer's streams before ``hc_head``), and provides
        ``hidden_shape``.  With multi-token-prediction layers (its family has
        ``load_mtp_weights``) it provides ``mtp_step_metadata`` (as :meth:`step_metadata`) and
        ``mtp_forward(md, cache, hidden) -> (logits of the sampling rows, output hidden states)``,
        and its :meth:`cache_specs` include the MTP layer's caches after the main layers'.
        A family with ``mtp_kind="dspark"`` instead writes the drafter's context in its forward
        (no hidden states tapped) and provides ``dspark_step_metadata`` and
        ``dspark_forward(md, cache) -> (base logits, collapsed hidden)`` of every block row.
        The draft model names what it reads in ``required_members``, checked at build.
        """
        ...

    def weight_bytes(self) -> int:
        """Bytes of the weights held."""
        ...

    def quantized_weight_bytes(self) -> int:
        """The part of :meth:`weight_bytes` held quantised."""
        ...


@dataclass(frozen=True)
class ModelFamily:
    """One architecture, as the engine uses it.

    Attributes:
        model_type: the ``config.json`` ``model_type`` it serves.
        parse_config: ``(data, source) -> ModelConfig``; raises :class:`ConfigError` naming
            ``source`` (the file) and the bad or missing field.
        load_weights: ``(model_dir, cfg, dtype, device, keep_quantized) -> {name: weight}``
            (``keep_quantized``: the ``QUANTIZED_FORMATS`` names to keep quantised).
        build_model: ``(cfg, weights, ops) -> Model``.
        cache_ratios: ``cfg -> ratios``: every page must hold whole entries of each (the
            default page size is a multiple of all of them); ``[]`` for a model without
            compressed caches.
        replay_tail: ``(cfg, page_size) -> tokens`` recomputed before a prefix-cache hit to
            rebuild the sliding-window caches exactly (0 for a model without windows).
        description: one line for ``deepinfer plugins``.
        load_mtp_weights: ``(model_dir, cfg, dtype, device, keep_quantized) -> {name: weight}``,
            the checkpoint's multi-token-prediction layer (``None``: the family has none).  The
            ``mtp`` drafter needs it: the runner then merges these weights into
            ``build_model``'s, calls ``replay_tail(cfg, page_size, extra_layers=1)`` and uses
            the model's MTP members (see :meth:`Model.forward`); it raises a one-line
            :class:`ConfigError` when the checkpoint lacks the layer.
        mtp_kind: what ``load_mtp_weights`` loads: ``"mtp"`` (DeepSeek-V4's multi-token-prediction
            layer, the core's ``mtp`` drafter) or ``"dspark"`` (DeepSeek-V4.1's DSpark block
            drafter, the core's ``dspark`` drafter; its model writes the drafter's context itself
            and taps no hidden states).  A drafter whose
            :attr:`~deepinfer_core.speculative.Drafter.mtp_kind` differs is refused (one-line
            :class:`ConfigError` naming the drafter to use).
        unsupported_draft_layers: ``cfg -> reason | None``: why no drafter can run the draft
            layers of the checkpoint ``cfg`` describes (``None``, or the attribute unset: the
            family's ``mtp_kind`` drafter can); a drafter that uses draft layers is then refused
            with the reason, before the model loads.
        builtin_model_dir: ``() -> directory`` of the family's built-in model, made locally on
            first use (never downloaded); ``None``: the family has none.  The engine's default
            model (``model=None``) is that of :data:`DEFAULT_MODEL_TYPE`
            (:func:`default_model_dir`).
    """

    model_type: str
    parse_config: Callable[[dict[str, Any], str], ModelConfig]
    load_weights: Callable[[Path, Any, torch.dtype, torch.device, Collection[str]], dict[str, Any]]
    build_model: Callable[[Any, dict[str, Any], OpTable], Model]
    cache_ratios: Callable[[Any], list[int]]
    replay_tail: Callable[..., int]
    description: str = ""
    load_mtp_weights: (
        Callable[[Path, Any, torch.dtype, torch.device, Collection[str]], dict[str, Any]] | None
    ) = None
    mtp_kind: str = "mtp"
    unsupported_draft_layers: Callable[[Any], str | None] | None = None
    builtin_model_dir: Callable[[], Path] | None = None

    def from_file(self, model_dir: str | Path) -> Any:
        """Parse ``config.json`` (or a directory holding it), checking its ``model_type``."""
        data, path = read_config_json(model_dir)
        data = _text_config(data, {self.model_type})
        model_type = data.get("model_type")
        if model_type != self.model_type:
            raise ConfigError(f"{path}: model_type is {model_type!r}, expected {self.model_type!r}")
        return self.parse_config(data, str(path))


def read_config_json(model_dir: str | Path) -> tuple[dict[str, Any], Path]:
    """The ``config.json`` of ``model_dir`` (or that file itself) as a dict, and its path."""
    p = Path(model_dir)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json at {p}: a model directory needs config.json and safetensors")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a JSON object, got {type(data).__name__}")
    return data, p


def _text_config(data: dict[str, Any], known: Collection[str]) -> dict[str, Any]:
    """A wrapper config (``text_config`` of a multimodal checkpoint) unwrapped when its own
    ``model_type`` is not a known family and the text config's is."""
    inner = data.get("text_config")
    if data.get("model_type") not in known and isinstance(inner, dict) and inner.get("model_type") in known:
        return inner
    return data


def get_family(plugins: Any, model_type: str, source: str = "config.json") -> ModelFamily:
    """The registered family of ``model_type``; a one-line :class:`ConfigError` listing the
    registered families when none is (a :class:`PluginError` when the plugin's factory gives
    something else than a :class:`ModelFamily` of that ``model_type``)."""

    def check(family: Any, spec: Any) -> str | None:
        if isinstance(family, ModelFamily) and family.model_type == model_type:
            return None
        return (
            f"(plugin {spec.plugin!r}): the factory returned {family!r}; expected a ModelFamily "
            f"with model_type {model_type!r}"
        )

    label = f"{source}: model_type {{}}"
    lookup = ComponentLookup(
        plugins, "models", label, hint=f"; {PLUGIN_HINT}", check=check, check_error=PluginError
    )
    return lookup.get(model_type)


def resolve_family(model_dir: str | Path, plugins: Any = None) -> tuple[ModelFamily, Any]:
    """The family of ``model_dir``'s ``config.json`` (by its ``model_type``) and the parsed config.

    Args:
        model_dir: the checkpoint directory (or its ``config.json``).
        plugins: the plugin manager (default: the process-wide one).
    """
    if plugins is None:
        plugins = get_plugins()
    data, path = read_config_json(model_dir)
    data = _text_config(data, plugins.components["models"])
    model_type = data.get("model_type")
    if model_type is None:
        raise ConfigError(
            f"{path} has no model_type; set it to one of the registered model families: "
            f"{sorted(plugins.components['models'])}"
        )
    if not isinstance(model_type, str):
        raise ConfigError(f"{path}: model_type must be a string, got {model_type!r}")
    family = get_family(plugins, model_type, str(path))
    return family, family.parse_config(data, str(path))


def default_model_dir(plugins: Any = None) -> Path:
    """The directory of the engine's default model: the built-in model of the registered
    :data:`DEFAULT_MODEL_TYPE` family (a one-line :class:`ConfigError` when it has none).

    Args:
        plugins: the plugin manager (default: the process-wide one).
    """
    if plugins is None:
        plugins = get_plugins()
    family = get_family(plugins, DEFAULT_MODEL_TYPE, "the default model")
    if family.builtin_model_dir is None:
        raise ConfigError(
            f"model family {DEFAULT_MODEL_TYPE!r} has no built-in model; pass model=<checkpoint directory>"
        )
    return family.builtin_model_dir()
