"""DeepSeek-V4 model configuration, parsed from a checkpoint's ``config.json``.

Accepts both the HF-transformers layout (``layer_types``, ``compress_rates``,
``mlp_layer_types``, nested ``rope_parameters``) and the native DeepSeek layout
(``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, flat ``rope_scaling``),
normalising to one form.  Validation errors name the offending field.

:meth:`DeepseekV4Config.from_dict` checks ``model_type`` (``deepseek_v4``) and requires every
field that decides a tensor or cache shape (:data:`SHAPE_FIELDS`, each satisfied by one of its
layouts' names); a missing one is an error naming it and the file.  The other fields (norm
epsilons, rope thetas and scaling, routing constants, token ids, ``max_position_embeddings``)
keep V4-Flash defaults.  Keys this config does not know are accepted and listed once per
parse at DEBUG level on ``deepinfer.model``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from deepinfer_core.models.config_utils import check_fields, check_model_type, eos_list, validate_config
from deepinfer_core.models.registry import read_config_json

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
MODEL_TYPE = "deepseek_v4"

SHAPE_FIELDS: tuple[tuple[str, ...], ...] = (
    ("vocab_size",),
    ("hidden_size",),
    ("moe_intermediate_size",),
    ("num_hidden_layers",),
    ("num_attention_heads",),
    ("head_dim",),
    ("q_lora_rank",),
    ("o_lora_rank",),
    ("o_groups",),
    ("n_routed_experts",),
    ("n_shared_experts",),
    ("num_experts_per_tok",),
    ("hc_mult",),
    ("sliding_window",),
    ("index_n_heads",),
    ("index_head_dim",),
    ("index_topk",),
    ("layer_types", "compress_ratios"),
    ("mlp_layer_types", "num_hash_layers"),
    ("partial_rotary_factor", "qk_rope_head_dim"),
)
"""Fields that decide shapes, each as the names that can give it (HF layout first, then
native); with HF ``layer_types``, the rate of each compressed type present is required too
(``compress_rates`` or ``compress_rate_csa`` / ``compress_rate_hca``)."""

# names of the native layout (and of HF's derived fields) consumed by the normalisation, and
# HF's bookkeeping keys: known, so not listed as unknown
_LAYOUT_KEYS = frozenset(
    {
        "architectures",
        "transformers_version",
        "dtype",
        "compress_ratios",
        "compress_rate_csa",
        "compress_rate_hca",
        "num_hash_layers",
        "qk_rope_head_dim",
        "rope_parameters",
        "rope_scaling",
    }
)

DSPARK_STAGES_UNSUPPORTED = (
    "this DeepSeek-V4 checkpoint's mtp.* tensors are DSpark block-drafter stages (main_proj, "
    "main_norm, Markov and confidence heads, as in DeepSeek-V4-Flash-0731), not a "
    "multi-token-prediction layer, and DeepInfer does not support DeepSeek-V4's DSpark drafter "
    "(the dspark drafter serves DeepSeek-V4.1's); the main model serves without a drafter: drop "
    "the speculative options or use drafter='ngram'"
)
"""Why no drafter runs the draft layers of a DeepSeek-V4 checkpoint with DSpark stages."""


class RopeParams(BaseModel):
    """Rotary parameters of one rope family (``main`` or ``compress``)."""

    model_config = ConfigDict(extra="ignore")
    rope_type: Literal["default", "yarn"] = "default"
    rope_theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


class DeepseekV4Config(BaseModel):
    """Architecture hyper-parameters of a DeepSeek-V4 checkpoint (HF field names).

    Fields without a default decide shapes (:data:`SHAPE_FIELDS`); build one with
    :meth:`from_dict` / :meth:`from_file`, which check them and ``model_type`` first.
    """

    model_config = ConfigDict(extra="ignore")
    model_type: str = "deepseek_v4"
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 1
    head_dim: int
    q_lora_rank: int
    num_experts_per_tok: int
    n_routed_experts: int
    n_shared_experts: int
    scoring_func: Literal["sqrtsoftplus", "softmax", "sigmoid"] = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    layer_types: list[str]
    compress_rates: dict[str, int]
    mlp_layer_types: list[str]
    hc_mult: int
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int = 1
    mtp_layer_types: list[str] | None = None
    # DSpark block-drafter stages in ``mtp.*`` instead of an MTP layer (DeepSeek-V4-Flash-0731);
    # read only to refuse them plainly (:data:`DSPARK_STAGES_UNSUPPORTED`)
    dspark_block_size: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: list[int] | None = None
    dspark_markov_rank: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    partial_rotary_factor: float
    rope_main: RopeParams
    rope_compress: RopeParams
    torch_dtype: str | None = None
    quantization_config: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        d = dict(data)
        n = int(d.get("num_hidden_layers") or 0)  # required: a missing one is reported below
        rates = {CSA: 4, HCA: 128, **(d.get("compress_rates") or {})}
        if "compress_rate_csa" in d:
            rates[CSA] = d.pop("compress_rate_csa")
        if "compress_rate_hca" in d:
            rates[HCA] = d.pop("compress_rate_hca")
        d["compress_rates"] = rates
        ratios = d.pop("compress_ratios", None)
        if d.get("layer_types") is None and ratios is not None:
            inv = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA, **_RATIO_TO_TYPE}
            bad = sorted({int(r) for r in ratios[:n]} - set(inv))
            if bad:
                raise ValueError(f"compress_ratios has {bad}, neither 0 nor a CSA/HCA rate of {rates}")
            d["layer_types"] = [inv[int(r)] for r in ratios[:n]]
            if d.get("mtp_layer_types") is None and len(ratios) > n:
                # the native list may go on with the MTP layers' ratios (0 = sliding window)
                n_mtp = int(d.get("num_nextn_predict_layers", 1) or 0)
                extra = [int(r) for r in ratios[n : n + n_mtp]]
                bad = sorted(set(extra) - set(inv))
                if bad:
                    raise ValueError(f"compress_ratios has {bad}, neither 0 nor a CSA/HCA rate of {rates}")
                d["mtp_layer_types"] = [inv[r] for r in extra]
        if d.get("layer_types") is None:
            inter = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            d["layer_types"] = [HCA] * min(n, 2) + inter
        n_mtp = int(d.get("num_nextn_predict_layers", 1) or 0)
        mtp = list(d.get("mtp_layer_types") or [])
        d["mtp_layer_types"] = mtp + [SLIDING] * max(0, n_mtp - len(mtp))
        if d.get("mlp_layer_types") is None:
            n_hash = int(d.pop("num_hash_layers", 3))
            d["mlp_layer_types"] = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        head_dim = int(d.get("head_dim") or 512)
        if d.get("partial_rotary_factor") is None:
            rope_dim = d.pop("qk_rope_head_dim", None)
            d["partial_rotary_factor"] = (rope_dim / head_dim) if rope_dim is not None else 64 / 512
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main, comp = dict(rp["main"]), dict(rp["compress"])
        else:
            yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            if "type" in yarn and "rope_type" not in yarn:
                yarn["rope_type"] = yarn.pop("type")
            main = {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)}
            comp = {**yarn, "rope_theta": d.get("compress_rope_theta", 160000.0)}
            comp.setdefault("rope_type", "default")
            if comp["rope_type"] == "yarn":
                comp.setdefault("attention_factor", 1.0)
        d["rope_main"], d["rope_compress"] = main, comp
        return d

    @model_validator(mode="after")
    def _check(self) -> DeepseekV4Config:
        n = self.num_hidden_layers
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, ("hash_moe", "moe")),
        ):
            if len(types) != n:
                raise ValueError(f"{name} has {len(types)} entries but num_hidden_layers is {n}")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"{name} entries must be one of {allowed}; got {bad}")
        if self.num_nextn_predict_layers < 0:
            raise ValueError("num_nextn_predict_layers must be >= 0")
        mtp = self.mtp_layer_types or []
        if len(mtp) != self.num_nextn_predict_layers:
            raise ValueError(
                f"mtp_layer_types has {len(mtp)} entries but num_nextn_predict_layers is "
                f"{self.num_nextn_predict_layers}"
            )
        bad = sorted({t for t in mtp if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"mtp_layer_types entries must be one of {LAYER_TYPES}; got {bad}")
        if self.num_key_value_heads != 1:
            raise ValueError("DeepSeek-V4 uses one shared KV head; num_key_value_heads must be 1")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError("num_attention_heads*head_dim must be divisible by o_groups")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(
                f"rope dim head_dim*partial_rotary_factor={self.rope_dim} must be even and <= head_dim"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok exceeds n_routed_experts")
        return self

    # ---- derived -------------------------------------------------------------------------
    @property
    def rope_dim(self) -> int:
        """Number of trailing channels per head that carry (interleaved) RoPE."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, layer: int) -> str:
        """Attention kind of ``layer``: a main layer's ``layer_types`` entry, or for ``layer =
        num_hidden_layers + i`` that of multi-token-prediction layer ``i`` (``mtp_layer_types``,
        from the native ``compress_ratios[num_hidden_layers + i]``; sliding window by default)."""
        n = self.num_hidden_layers
        return self.layer_types[layer] if layer < n else (self.mtp_layer_types or [])[layer - n]

    def compress_ratio(self, layer: int) -> int:
        """Compression ratio of ``layer`` (0 for sliding-only layers; MTP layers count from
        ``num_hidden_layers``, see :meth:`layer_type`)."""
        t = self.layer_type(layer)
        return 0 if t == SLIDING else int(self.compress_rates[t])

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids as a list (``eos_token_id`` may be an int or a list)."""
        return eos_list(self.eos_token_id)

    @property
    def has_dspark_stages(self) -> bool:
        """Whether ``config.json`` declares DSpark block-drafter stages (any ``dspark_*`` field,
        as DeepSeek-V4-Flash-0731's does): its ``mtp.*`` tensors are then not an MTP layer."""
        fields = (self.dspark_block_size, self.dspark_noise_token_id, self.dspark_target_layer_ids)
        return any(f is not None for f in (*fields, self.dspark_markov_rank))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> DeepseekV4Config:
        """Parse and validate; raise :class:`ConfigError` naming ``source`` and the bad field.

        ``model_type`` must be ``deepseek_v4`` and every :data:`SHAPE_FIELDS` entry present;
        unknown keys are listed at DEBUG level.
        """
        _check_keys(data, source)
        return validate_config(cls, data, source, "DeepSeek-V4")

    @classmethod
    def from_file(cls, path: str | Path) -> DeepseekV4Config:
        """Read ``config.json`` (or a model directory containing it)."""
        data, p = read_config_json(path)
        if "text_config" in data and data.get("model_type") != MODEL_TYPE:
            data = data["text_config"]
        return cls.from_dict(data, source=str(p))


def _check_keys(data: dict[str, Any], source: str) -> None:
    """``model_type`` and the shape fields of ``data`` checked; its unknown keys logged."""
    check_model_type(data, source, "DeepSeek-V4", MODEL_TYPE)
    missing = [
        " or ".join(names) for names in SHAPE_FIELDS if not any(data.get(n) is not None for n in names)
    ]
    if data.get("compress_ratios") is None and isinstance(data.get("layer_types"), list):
        rates = data.get("compress_rates") or {}
        for kind, flat in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
            if kind in data["layer_types"] and rates.get(kind) is None and data.get(flat) is None:
                missing.append(f"compress_rates[{kind!r}] or {flat}")
    check_fields(data, source, "DeepSeek-V4", missing, DeepseekV4Config.model_fields.keys() | _LAYOUT_KEYS)
