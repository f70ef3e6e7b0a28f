"""Tensor names: native DeepSeek checkpoint names <-> HF transformers names.

HF names (``model.layers.0.self_attn.q_a_proj.weight``, stacked experts
``model.layers.i.mlp.experts.gate_up_proj`` ``[E, 2I, D]`` and ``down_proj`` ``[E, D, I]``) are
what :func:`deepinfer_core.models.deepseek_v4.params.parameter_specs` uses.  Native DeepSeek
names (``layers.0.attn.wq_a.weight``, per-expert ``layers.i.ffn.experts.e.w1.weight``) follow
transformers' ``conversion_mapping["deepseek_v4"]``; the tables below state that mapping as
data.  ``w1`` is the gate, ``w3`` the up projection: ``gate_up_proj[e] = cat(w1, w3, dim=0)``.

Multi-token-prediction layers (native ``mtp.{i}.*``, loaded only for the ``mtp`` drafter) map
to ``model.mtp.{i}.*`` (:data:`MTP`): their decoder block uses a main layer's sub-names
(:data:`LAYER`, per-expert tensors stacked the same way), the rest is :data:`MTP_ONLY`.  HF
transformers has no MTP; these HF-style names are DeepInfer's, and its ``DeepseekV4ForCausalLM``
ignores them (``_keys_to_ignore_on_load_unexpected``).

transformers' ``save_pretrained`` writes a hybrid of the two (``model.`` prefix kept,
``model.embed_tokens.weight``, ``model.hc_head.hc_fn``, ``attn.norm.weight`` for the KV
norm); those spellings are accepted as read-only aliases of the native scheme.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Top-level tensors: native name -> HF name.  The first native spelling is the one written.
TOP_LEVEL: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
TOP_LEVEL_ALIASES: dict[str, str] = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "lm_head.weight": "lm_head.weight",
    "hc_head.hc_fn": "model.hc_head.hc_fn",
    "hc_head.hc_base": "model.hc_head.hc_base",
    "hc_head.hc_scale": "model.hc_head.hc_scale",
}

# Per-layer tensors, relative to ``layers.{i}.`` (native) and ``model.layers.{i}.`` (HF).
_COMPRESSOR = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight", "ape": "position_bias"}
LAYER: dict[str, str] = {
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.attn_sink": "self_attn.sinks",
    **{f"attn.compressor.{k}": f"self_attn.compressor.{v}" for k, v in _COMPRESSOR.items()},
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    **{f"attn.indexer.compressor.{k}": f"self_attn.compressor.indexer.{v}" for k, v in _COMPRESSOR.items()},
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
}
LAYER_ALIASES: dict[str, str] = {"attn.norm.weight": "self_attn.kv_norm.weight"}

# Multi-token-prediction layers: native ``mtp.{i}.<rest>`` -> HF-style ``model.mtp.{i}.<rest'>``
# with ``rest'`` from :data:`LAYER` for the decoder block, else from this table.
MTP_ONLY: dict[str, str] = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
    "norm.weight": "norm.weight",
    "head.weight": "lm_head.weight",
    "emb.tok_emb.weight": "embed_tokens.weight",
}
MTP = "model.mtp."  # HF-style prefix of the MTP layers (``params.MTP_PREFIX``)

# Routed experts: native projection -> (HF stacked tensor, part).
EXPERT_PARTS: dict[str, tuple[str, str]] = {
    "w1": ("gate_up_proj", "gate"),
    "w3": ("gate_up_proj", "up"),
    "w2": ("down_proj", "down"),
}
_PART_TO_NATIVE = {part: proj for proj, (_, part) in EXPERT_PARTS.items()}

_LAYER_RE = re.compile(r"^(?:model\.)?(layers|mtp)\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")
_HF_EXPERT_RE = re.compile(r"^model\.(layers|mtp)\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_HF_LAYER_RE = re.compile(r"^model\.(layers|mtp)\.(\d+)\.(.+)$")
_HF_TO_LAYER = {hf: native for native, hf in LAYER.items()}
_HF_TO_MTP = {hf: native for native, hf in MTP_ONLY.items()}
_HF_TO_TOP = {hf: native for native, hf in TOP_LEVEL.items()}


@dataclass(frozen=True)
class ExpertSlice:
    """One routed expert's projection inside an HF stacked expert tensor.

    ``part`` is ``"gate"`` (rows ``[0, I)`` of ``gate_up_proj[expert]``), ``"up"`` (rows
    ``[I, 2I)``) or ``"down"`` (all of ``down_proj[expert]``).
    """

    hf_name: str
    expert: int
    part: str


def native_to_hf(name: str) -> str | ExpertSlice | None:
    """The HF name (or expert slice) of native tensor ``name``; ``None`` if it is not native.

    An optional leading ``model.`` is accepted, as are transformers' ``save_pretrained``
    spellings (:data:`TOP_LEVEL_ALIASES`, :data:`LAYER_ALIASES`).
    """
    bare = name.removeprefix("model.")
    top = TOP_LEVEL.get(bare) or TOP_LEVEL_ALIASES.get(bare)
    if top is not None:
        return top
    m = _LAYER_RE.match(name)
    if m is None:
        return None
    group, layer, rest = m.group(1), int(m.group(2)), m.group(3)
    hf_rest = LAYER.get(rest) or LAYER_ALIASES.get(rest)
    if hf_rest is None and group == "mtp":
        hf_rest = MTP_ONLY.get(rest)
    if hf_rest is not None:
        return f"model.{group}.{layer}.{hf_rest}"
    e = _EXPERT_RE.match(rest)
    if e is None:
        return None
    stacked, part = EXPERT_PARTS[e.group(2)]
    return ExpertSlice(f"model.{group}.{layer}.mlp.experts.{stacked}", int(e.group(1)), part)


def hf_to_native(hf_name: str) -> str:
    """The native name of a non-expert HF tensor; raises ``KeyError`` if it has none."""
    if hf_name in _HF_TO_TOP:
        return _HF_TO_TOP[hf_name]
    m = _HF_LAYER_RE.match(hf_name)
    if m is not None:
        group, layer, rest = m.groups()
        native = _HF_TO_LAYER.get(rest) or (_HF_TO_MTP.get(rest) if group == "mtp" else None)
        if native is not None:
            return f"{group}.{layer}.{native}"
    raise KeyError(hf_name)


def expert_native_names(hf_name: str, expert: int) -> dict[str, str]:
    """Native names of expert ``expert``'s slices of stacked tensor ``hf_name``, by part.

    ``gate_up_proj`` -> ``{"gate": ...w1.weight, "up": ...w3.weight}``; ``down_proj`` ->
    ``{"down": ...w2.weight}``.  Raises ``KeyError`` for a name that is not an expert stack.
    """
    m = _HF_EXPERT_RE.match(hf_name)
    if m is None:
        raise KeyError(hf_name)
    group, layer, stacked = m.groups()
    parts = ("gate", "up") if stacked == "gate_up_proj" else ("down",)
    return {p: f"{group}.{layer}.ffn.experts.{expert}.{_PART_TO_NATIVE[p]}.weight" for p in parts}


def is_expert_stack(hf_name: str) -> bool:
    """Whether ``hf_name`` is a stacked routed-expert tensor (``gate_up_proj`` / ``down_proj``)."""
    return _HF_EXPERT_RE.match(hf_name) is not None


# ---- quantisation scale siblings -------------------------------------------------------------


def scale_candidates(weight_name: str) -> list[str]:
    """Names a block-scale tensor of ``weight_name`` may have, native spelling first.

    Native DeepSeek: ``X.weight`` -> ``X.scale``; HF: ``X.weight`` -> ``X.weight_scale_inv``
    and a parameter ``P`` (stacked experts) -> ``P_scale_inv``.
    """
    if weight_name.endswith(".weight"):
        stem = weight_name[: -len(".weight")]
        return [stem + ".scale", stem + ".weight_scale_inv"]
    return [weight_name + "_scale_inv", weight_name + ".scale"]


def scale_owner(name: str, all_names: set[str] | frozenset[str]) -> str | None:
    """The weight whose block scale ``name`` is, if ``name`` is a scale sibling in ``all_names``.

    A name is a scale only when its weight exists: ``model.layers.0.attn_hc.scale`` (an mHC
    parameter) has no ``attn_hc.weight`` partner and so is not a scale.
    """
    owners: list[str] = []
    if name.endswith("_scale_inv"):  # HF: X.weight_scale_inv, or P_scale_inv for a parameter P
        owners.append(name[: -len("_scale_inv")])
    if name.endswith(".scale"):
        stem = name[: -len(".scale")]
        owners += [stem + ".weight", stem]
    for owner in owners:
        if owner in all_names and owner != name:
            return owner
    return None


def is_mtp(name: str) -> bool:
    """Whether ``name`` is a multi-token-prediction tensor (native ``mtp.{i}.*`` or HF-style
    ``model.mtp.{i}.*``), loaded only for the ``mtp`` drafter."""
    return name.removeprefix("model.").startswith("mtp.")


def mtp_layer(name: str) -> int | None:
    """The MTP layer index of an MTP tensor name (:func:`is_mtp`), else ``None``."""
    m = _LAYER_RE.match(name)
    return int(m.group(2)) if m is not None and m.group(1) == "mtp" else None


DSPARK_STAGE_LEAVES = ("main_proj.", "main_norm.", "markov_head.", "confidence_head.")
"""Leaves (after ``mtp.{i}.``) only a DSpark block drafter's stages have: its context combiner and
its Markov and confidence heads; an MTP layer has none of them."""


def is_dspark_stage(name: str) -> bool:
    """Whether ``name`` is a tensor only DSpark drafter stages have (:data:`DSPARK_STAGE_LEAVES`)."""
    m = _LAYER_RE.match(name)
    return m is not None and m.group(1) == "mtp" and m.group(3).startswith(DSPARK_STAGE_LEAVES)


def is_ignorable(name: str) -> bool:
    """Tensors a checkpoint may carry that the model does not load: rotary ``inv_freq``
    buffers, and the multi-token-prediction layers (``mtp.*``, :func:`is_mtp`) unless the
    ``mtp`` drafter asks for them."""
    return is_mtp(name) or name.endswith("inv_freq")
