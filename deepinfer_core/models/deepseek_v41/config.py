"""DeepSeek-V4.1 model configuration, parsed from a checkpoint's ``config.json``.

The released checkpoint (``deepseek-ai/DeepSeek-V4.1-Flash``) is an image-text-to-text model:
its ``config.json`` says ``model_type: deepseek_v41`` and nests the text backbone in
``text_config`` (``model_type: deepseek_v41_text``) next to a ``vision_config``, with the
``quantization_config`` at the top level.  :meth:`DeepseekV41Config.from_dict` takes that
wrapper (or a bare text config), keeps the text part, merges the top-level quantisation config
into it, and ignores the vision part (one INFO line: the vision tower is not served).

Field names are transformers' ``DeepseekV41TextConfig`` (transformers main), which mirrors the
released ``text_config`` but for one key: the release's ``engram_pad_token_id`` is read as
``engram_pad_id`` (both given and different: an error).  Every field that decides a tensor or
cache shape is required (:data:`~.config_layout.SHAPE_FIELDS`, plus the engram sizes when ``engram_layer_ids``
is not empty); a missing one is an error naming it and the file.  The numeric constants keep
the released defaults.  Keys this config does not know are accepted and listed once per parse
at DEBUG level on the ``deepinfer.model`` logger.

The causal encoder-decoder (CED) layout is checked as transformers checks it, plus what the
engine relies on (each kv-source layer also scores, so its group has indexer keys; every
compressed layer of a group has its source's ratio); see :meth:`DeepseekV41Config._check`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from deepinfer_core.errors import ConfigError
from deepinfer_core.models.config_utils import eos_list, validate_config
from deepinfer_core.models.deepseek_v4.config import RopeParams

from .config_layout import LABEL, MODEL_TYPE, check_text_keys, unwrap_text_config


class QuantizationConfig(BaseModel):
    """The checkpoint's ``quantization_config``: block-scaled FP8 (MXFP8) dense linears and, with
    ``expert_dtype="fp4"`` (text config), MXFP4 routed experts."""

    model_config = ConfigDict(extra="allow")
    quant_method: str = "fp8"
    fmt: Literal["e4m3"] = "e4m3"
    scale_fmt: Literal["ue8m0", "float32"] | None = None
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (128, 128)

    @field_validator("weight_block_size", mode="before")
    @classmethod
    def _block(cls, v: Any) -> Any:
        if not isinstance(v, list | tuple) or len(v) != 2 or not all(isinstance(x, int) and x > 0 for x in v):
            raise ValueError(f"weight_block_size must be two positive ints, got {v!r}")
        return tuple(v)


class DeepseekV41Config(BaseModel):
    """Architecture hyper-parameters of a DeepSeek-V4.1 checkpoint's text backbone.

    Build one with :meth:`from_dict`, which unwraps the released wrapper config and checks the
    shape fields first.  ``compress_ratios`` keeps only the backbone's entries (the trailing
    DSpark draft layers' are in ``draft_compress_ratios``).
    """

    model_config = ConfigDict(extra="ignore")
    model_type: str = MODEL_TYPE
    # ---- attention / rope
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 1
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    max_position_embeddings: int = 1048576
    # ---- sliding window + shared compressed sparse attention (CSA2)
    sliding_window: int
    compress_ratios: list[int]
    draft_compress_ratios: list[int] = []
    kv_source_layer_ids: list[int]
    index_source_layer_ids: list[int]
    candidate_source_layer_id: int | None = None  # None: the last kv source; < 0: one-level top-k
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # ---- grouped low-rank output projection
    o_groups: int
    o_lora_rank: int
    # ---- MoE
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: Literal["sqrtsoftplus", "softmax", "sigmoid"] = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    topk_method: Literal["noaux_tc"] = "noaux_tc"
    swiglu_limit: float = 10.0
    expert_dtype: Literal["fp4", "fp8"] = "fp4"
    # ---- hyper-connections (single-pass mHC)
    hc_mult: int
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # ---- engram conditional memory
    engram_layer_ids: list[int]
    engram_vocab_size: int = 16000000
    engram_num_embeddings: list[int] = []
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # ---- DSpark draft layers (``mtp.{j}.*``; validated by :meth:`check_dspark` when the drafter loads)
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] | None = None
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # ---- misc
    hidden_act: Literal["silu"] = "silu"
    rms_norm_eps: float = 1e-20
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    quantization_config: dict[str, Any] | None = None
    image_token_id: int | None = None
    rope_main: RopeParams
    rope_compress: RopeParams

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        d = dict(data)
        n = int(d.get("num_hidden_layers") or 0)
        n_draft = int(d.get("num_nextn_predict_layers", 3) or 0)
        ratios = d.get("compress_ratios")
        if isinstance(ratios, list) and len(ratios) >= n:
            # the released list goes on with the DSpark draft layers' ratios (always 0)
            d["compress_ratios"] = ratios[:n]
            d["draft_compress_ratios"] = list(ratios[n:])
            if len(ratios) > n + n_draft:
                raise ValueError(
                    f"compress_ratios has {len(ratios)} entries but num_hidden_layers + "
                    f"num_nextn_predict_layers is {n + n_draft}"
                )
        rp = d.get("rope_parameters") or {}
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main, comp = dict(rp["main"]), dict(rp["compress"])
        else:
            yarn = {k: v for k, v in (d.get("rope_scaling") or rp).items() if k not in ("main", "compress")}
            if "type" in yarn and "rope_type" not in yarn:
                yarn["rope_type"] = yarn.pop("type")
            main = {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)}
            comp = {**yarn, "rope_theta": d.get("compress_rope_theta", 160000.0)}
            comp.setdefault("rope_type", "default")
            if comp["rope_type"] == "yarn":
                comp.setdefault("attention_factor", 1.0)  # YaRN's mscale is not applied
        d["rope_main"], d["rope_compress"] = main, comp
        if d.get("torch_dtype") is None and isinstance(d.get("dtype"), str):
            d["torch_dtype"] = d["dtype"]
        if "engram_pad_token_id" in d:  # the released config's spelling of engram_pad_id
            pad = d.pop("engram_pad_token_id")
            if d.get("engram_pad_id", pad) != pad:
                raise ValueError(
                    f"engram_pad_token_id ({pad}) and engram_pad_id ({d['engram_pad_id']}) differ; they name "
                    "the same token, keep one"
                )
            d["engram_pad_id"] = pad
        return d

    @model_validator(mode="after")
    def _check(self) -> DeepseekV41Config:
        n = self.num_hidden_layers
        ratios = self.compress_ratios
        if len(ratios) != n:
            raise ValueError(f"compress_ratios has {len(ratios)} entries but num_hidden_layers is {n}")
        if any(r < 0 for r in ratios):
            raise ValueError(f"compress_ratios must be >= 0, got {ratios}")
        if any(r != 0 for r in self.draft_compress_ratios):
            raise ValueError(
                f"compress_ratios of the draft layers (after the first {n}) must be 0, got "
                f"{self.draft_compress_ratios}"
            )
        kv, ix = self.kv_source_layer_ids, self.index_source_layer_ids
        for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", ix)):
            if any(i < 0 or i >= n for i in ids):
                raise ValueError(f"{name} out of range [0, {n}): {ids}")
            if any(ratios[i] == 0 for i in ids):
                raise ValueError(f"{name} {ids} must have compress_ratios[i] > 0")
            if len(set(ids)) != len(ids) or ids != sorted(ids):
                raise ValueError(f"{name} must be increasing without repeats, got {ids}")
        for i in range(n):
            if ratios[i] and not any(s <= i for s in kv):
                raise ValueError(
                    f"layer {i} has compress_ratios {ratios[i]} but no kv_source_layer_ids entry at or "
                    "before it"
                )
            if ratios[i] and ratios[i] != ratios[self.kv_source(i)]:
                raise ValueError(
                    f"layer {i} has compress_ratios {ratios[i]} but reads the compressed cache of kv source "
                    f"{self.kv_source(i)} (ratio {ratios[self.kv_source(i)]}); a group shares one ratio"
                )
        missing = [s for s in kv if s not in ix]
        if missing:
            raise ValueError(
                f"kv source layers {missing} are not in index_source_layer_ids {ix}: only an index source "
                "derives the indexer keys its group scores against"
            )
        c = self.candidate_source_layer_id
        if c is None:
            self.candidate_source_layer_id = kv[-1] if kv else -1
        elif c >= 0 and c not in ix:
            raise ValueError(f"candidate_source_layer_id ({c}) must be in index_source_layer_ids {ix}")
        if self.candidate_topk_blocks < 1 or self.candidate_block_size < 1:
            raise ValueError("candidate_topk_blocks and candidate_block_size must be >= 1")
        if self.index_topk < 1:
            raise ValueError("index_topk must be >= 1")
        if self.num_key_value_heads != 1:
            raise ValueError("DeepSeek-V4.1 uses one shared KV head; num_key_value_heads must be 1")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError("num_attention_heads*head_dim must be divisible by o_groups")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"qk_rope_head_dim={self.rope_dim} must be even and <= head_dim")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok exceeds n_routed_experts")
        if self.hc_mult < 1 or self.sliding_window < 1:
            raise ValueError("hc_mult and sliding_window must be >= 1")
        e = self.engram_layer_ids
        if any(i < 0 or i >= n for i in e) or len(set(e)) != len(e):
            raise ValueError(f"engram_layer_ids must be distinct layers in [0, {n}), got {e}")
        if len(self.engram_num_embeddings) != len(e):
            raise ValueError(
                f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries but engram_layer_ids "
                f"has {len(e)}"
            )
        if e and self.engram_max_ngram_size < 2:
            raise ValueError("engram_max_ngram_size must be >= 2")
        if self.num_nextn_predict_layers < 0:
            raise ValueError("num_nextn_predict_layers must be >= 0")
        if self.dspark_target_layer_ids is None:  # transformers' default: the last 3 non-source layers
            self.dspark_target_layer_ids = sorted([i for i in range(n) if i not in kv][-3:])
        if self.quantization_config is not None:
            QuantizationConfig.model_validate(self.quantization_config)
        return self

    # ---- derived -------------------------------------------------------------------------
    @property
    def rope_dim(self) -> int:
        """Trailing channels per head that carry (interleaved) RoPE."""
        return self.qk_rope_head_dim

    @property
    def quant(self) -> QuantizationConfig | None:
        """The validated quantisation config, if the checkpoint has one."""
        if self.quantization_config is None:
            return None
        return QuantizationConfig.model_validate(self.quantization_config)

    def compress_ratio(self, layer: int) -> int:
        """0: sliding window only; 1: full-resolution shared KV (CED decoder); r > 1: r tokens
        pooled per entry (CED encoder).  Layers from ``num_hidden_layers`` on are the DSpark draft
        layers (always 0)."""
        return self.compress_ratios[layer] if layer < self.num_hidden_layers else 0

    @property
    def dspark_num_layers(self) -> int:
        """Draft layers of the DSpark drafter (``num_nextn_predict_layers``)."""
        return self.num_nextn_predict_layers

    def check_dspark(self, source: str = "config") -> None:
        """The DSpark fields a drafter needs (checked when it loads, not at parse time, so
        configs without a drafter still parse); a one-line :class:`ConfigError` naming ``source``
        and the field."""
        n, v = self.num_hidden_layers, self.vocab_size
        ids = self.dspark_target_layer_ids or []
        problems = []
        if self.num_nextn_predict_layers < 1:
            problems.append("num_nextn_predict_layers must be >= 1 (no DSpark draft layers)")
        if not ids or any(i < 0 or i > n for i in ids) or ids != sorted(set(ids)):
            problems.append(f"dspark_target_layer_ids must be strictly increasing ids in [0, {n}], got {ids}")
        if not 0 <= self.dspark_noise_token_id < v:
            problems.append(f"dspark_noise_token_id {self.dspark_noise_token_id} not in the vocab [0, {v})")
        if self.dspark_block_size < 1:
            problems.append(f"dspark_block_size must be >= 1, got {self.dspark_block_size}")
        if self.dspark_markov_rank < 1:
            problems.append(f"dspark_markov_rank must be >= 1, got {self.dspark_markov_rank}")
        if not 1 <= self.dspark_num_experts_per_tok <= self.dspark_n_routed_experts:
            problems.append(
                f"dspark_num_experts_per_tok ({self.dspark_num_experts_per_tok}) must be in [1, "
                f"dspark_n_routed_experts ({self.dspark_n_routed_experts})]"
            )
        if problems:
            raise ConfigError(f"{source}: DSpark drafter: {problems[0]}")

    def kv_source(self, layer: int) -> int:
        """The kv-source layer whose compressed cache ``layer`` reads (the closest at or before
        it); only for layers with a compress ratio."""
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source(self, layer: int) -> int:
        """The index-source layer whose top-k ``layer`` attends with (the closest at or before
        it; never before its kv source, see :meth:`_check`)."""
        return max(s for s in self.index_source_layer_ids if s <= layer)

    def is_kv_source(self, layer: int) -> bool:
        return layer in self.kv_source_layer_ids

    def is_index_source(self, layer: int) -> bool:
        return layer in self.index_source_layer_ids

    def uses_candidates(self, layer: int) -> bool:
        """Whether ``layer`` (an index source) scores only inside the candidate blocks of the
        candidate source (the hierarchical two-level top-k)."""
        c = self.candidate_source_layer_id
        return c is not None and 0 <= c < layer

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids as a list (``eos_token_id`` may be an int or a list)."""
        return eos_list(self.eos_token_id)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> DeepseekV41Config:
        """Parse and validate; raise :class:`ConfigError` naming ``source`` and the bad field.

        ``data`` is the released wrapper (``model_type: deepseek_v41`` with ``text_config``) or a
        bare text config (``deepseek_v41_text``).  Every :data:`~.config_layout.SHAPE_FIELDS` entry
        must be present; unknown keys are listed at DEBUG level; a ``vision_config`` is ignored
        with one INFO line.
        """
        text = unwrap_text_config(data, source)
        check_text_keys(text, source, cls.model_fields)
        return validate_config(cls, text, source, LABEL)
