"""The engine options' sections: speculative decoding (:class:`SpeculativeConfig`) and
expert-parallel load balancing (:class:`EPLBConfig`), each a field of
:class:`~deepinfer_core.config.EngineConfig` (given as the object, a dict or a JSON object of
its fields)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator


class SpeculativeConfig(BaseModel):
    """Speculative decoding (``EngineConfig.speculative``): a drafter proposes tokens, one target
    forward verifies them, and the accepted prefix plus the target's own next token are kept.
    See ``docs/speculative_decoding.md``."""

    model_config = ConfigDict(extra="forbid")

    method: str = "dspark"
    """How many drafts each request verifies per step, a verify-length policy by registered name
    (``deepinfer_register_verify_policies``): the core's ``fixed`` = all the drafter proposed
    (up to ``max_draft_tokens``); ``dspark`` = confidence-scheduled: the length whose expected
    accepted tokens per unit of measured step cost is best, from the drafts' confidences."""
    drafter: str = "ngram"
    """Drafter by registered name (``deepinfer_register_drafters``); the core's ``ngram`` looks
    the last tokens up in the prompt and output (prompt lookup decoding, no weights), its
    ``mtp`` runs DeepSeek-V4's multi-token-prediction layer (``num_nextn_predict_layers``), its
    ``dspark`` DeepSeek-V4.1's DSpark block drafter (``mtp.*``; at most ``dspark_block_size``
    drafts per step).  (``method="dspark"`` is the verify-length policy, usable with any drafter.)"""
    max_draft_tokens: int = 5
    """Most draft tokens verified per request and step (``DEEPINFER_USE_NEXTN_DECODE``)."""
    acceptance: Literal["match", "rejection"] = "match"
    """``match``: the target draws its token at every verified position with the counter-based
    randomness of plain decoding and drafts are accepted while equal to it, so outputs are
    identical with and without speculation; ``rejection``: rejection sampling against the
    drafter's distribution (distribution-exact, not token-identical)."""
    varlen: bool = True
    """``dspark``: each request verifies its own number of drafts (the varlen verify the seed's
    kernels take); ``False``: one number for every request of a step, the best uniform length
    (``DEEPINFER_ENABLE_MTP_VARLEN=0``; for backends whose verify kernels want one length)."""
    ngram_min: int = 1
    """``ngram`` drafter: shortest suffix matched."""
    ngram_max: int = 4
    """``ngram`` drafter: longest suffix matched (longer matches are tried first)."""

    @field_validator("max_draft_tokens")
    @classmethod
    def _draft_len(cls, value: int) -> int:
        if not 1 <= value <= 16:
            raise ValueError("must be in [1, 16]")
        return value

    @field_validator("ngram_min", "ngram_max")
    @classmethod
    def _ngram(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be >= 1")
        return value

    @model_validator(mode="after")
    def _ngram_order(self) -> SpeculativeConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        return self


class EPLBConfig(BaseModel):
    """Expert-parallel load balancing (``EngineConfig.eplb``): per-expert load statistics over a
    sliding window of steps, and a periodic rebalancing that replicates the hottest experts into
    ``num_redundant_experts`` extra slots and repacks experts onto ranks.  See
    ``docs/distributed.md``."""

    model_config = ConfigDict(extra="forbid")

    window_steps: int = 1000
    """Steps of routing statistics the rebalancing looks at (a sliding window)."""
    rebalance_interval: int = 3000
    """Rebalance every this many steps (weights move between two steps; the engine keeps running)."""
    num_redundant_experts: int = 0
    """Extra physical expert slots over all ranks, filled with replicas of the hottest experts
    (``num_experts + num_redundant_experts`` must divide by the EP size)."""
    policy: Literal["hierarchical", "global"] = "hierarchical"
    """``hierarchical``: expert groups packed onto nodes, then replicas and GPUs within each node
    (DeepSeek's EPLB for prefill-sized EP); ``global``: replicate and pack over all ranks at once."""
    num_nodes: int | None = None
    """Nodes of the hierarchical policy; ``None`` = from the launch (hosts of the world)."""
    layers_per_step: int | None = None
    """Spread a rebalancing's weight move over steps, this many changed MoE layers after each
    step (each layer's placement published once its weights are in place); ``None`` = every
    layer at once, between two steps."""

    @field_validator("window_steps", "rebalance_interval")
    @classmethod
    def _steps(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be >= 1")
        return value

    @field_validator("num_redundant_experts")
    @classmethod
    def _redundant(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0")
        return value

    @field_validator("num_nodes", "layers_per_step")
    @classmethod
    def _nodes(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be >= 1")
        return value
