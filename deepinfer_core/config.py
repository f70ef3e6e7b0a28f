"""Engine configuration: one pydantic model, four sources.

Precedence, lowest to highest (documented in ``docs/configuration.md``):

1. the defaults of :class:`EngineConfig`;
2. a config file (TOML ``.toml`` or YAML ``.yaml``/``.yml``) of top-level ``field = value`` keys;
3. ``DEEPINFER_<FIELD>`` environment variables (``DEEPINFER_MAX_NUM_SEQS=8``), parsed by field type;
4. keyword arguments (``LLM(max_num_seqs=8)``) and CLI flags.

A keyword argument of ``None`` means "not given" and does not override a lower source.
Every error is a :class:`~deepinfer_core.errors.ConfigError` naming the field and the source
that supplied the bad value.
"""

from __future__ import annotations

import contextvars
import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from deepinfer_core.config_sections import EPLBConfig, SpeculativeConfig
from deepinfer_core.config_sources import (
    ENV_PREFIX,
    NEXTN_ENV,
    VARLEN_ENV,
    apply_nextn_env,
    apply_varlen_env,
    did_you_mean,
    env_values,
    env_var_name,
    format_errors,
    read_options_file,
)
from deepinfer_core.errors import ConfigError
from deepinfer_core.weights.quant import QUANTIZED_FORMATS

__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "ENV_PREFIX",
    "EPLBConfig",
    "EngineConfig",
    "MAX_INT_OPTION",
    "NEXTN_ENV",
    "PAGE_SIZE_QUANTUM",
    "SpeculativeConfig",
    "VARLEN_ENV",
    "did_you_mean",
    "env_var_name",
    "read_config_file",
]

DEFAULT_MAX_MODEL_LEN = 8192
PAGE_SIZE_QUANTUM = 16
MAX_INT_OPTION = 2**31  # sizes and counts beyond this are typos, and overflow int32 indices

# where each field's value came from, for error messages (set by EngineConfig.validated)
_ORIGIN: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "engine_config_origin", default=None
)

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDtype = Literal["auto", "fp8"]
LogLevel = Literal["debug", "info", "warning", "error"]


class EngineConfig(BaseModel):
    """Everything that shapes one engine.  See ``docs/configuration.md`` for each field.

    Build one with :meth:`load` to merge a config file, environment variables and keyword
    arguments; constructing it directly validates only the given values.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str | None = None
    """Model directory (``config.json`` + safetensors), or a Hugging Face Hub repo id
    (``org/name[@revision]``, fetched into the HF cache: :mod:`deepinfer_core.hub`); ``None`` =
    the built-in tiny model (no download)."""
    tokenizer: str | None = None
    """Tokenizer directory or Hub repo id; ``None`` = the model directory."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of a ``model`` given as a repo id; ``None`` = ``main``."""
    download_dir: str | None = None
    """Hugging Face cache directory for Hub repos; ``None`` = ``$HF_HUB_CACHE``, ``$HF_HOME/hub``
    or ``~/.cache/huggingface/hub``."""
    backend: str = "auto"
    """``"auto"`` (highest-priority available backend), ``"reference"`` or a registered name."""
    strict_ops: bool = False
    """Raise instead of falling back to the reference op when the backend lacks an op or case."""
    dtype: Dtype = "auto"
    """Activation/weight dtype; ``auto`` = bfloat16 on accelerator backends, float32 on CPU."""
    device: str | None = None
    """torch device string; ``None`` = the backend's device type (``cuda`` -> ``cuda:0``...)."""
    max_num_seqs: int = 64
    """Most requests running at once (also the number of per-sequence cache slots)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decode tokens + prefill chunk tokens)."""
    max_model_len: int | None = None
    """Longest prompt + completion; ``None`` = min(model max_position_embeddings, 8192)."""
    page_size: int | None = None
    """Token positions per cache page; ``None`` = smallest multiple of 16 and of every compress ratio."""
    num_cache_pages: int | None = None
    """Pages in the cache pool; ``None`` = from ``kv_cache_memory_gb``, else enough for
    ``max_num_seqs`` sequences of ``max_model_len`` tokens."""
    kv_cache_memory_gb: float | None = None
    """Memory budget of the paged cache in GiB, used when ``num_cache_pages`` is unset."""
    kv_cache_dtype: KVCacheDtype = "auto"
    """Storage of the attention KV caches (window ring, compressed entries): ``auto`` = the model
    ``dtype``; ``fp8`` = packed FP8 rows as FlashMLA's V4 layout (e4m3 nope values with one
    power-of-two UE8M0 scale per 64, bfloat16 rope values: 592 bytes per 512-wide row), so the
    same ``kv_cache_memory_gb`` holds more tokens.  The indexer keys and compressor state stay
    in ``dtype``."""
    seed: int = 0
    """Engine seed: requests without their own seed draw from (seed, request index)."""
    enable_chunked_prefill: bool = True
    """Split long prompts into chunks that share steps with decodes."""
    enable_prefix_caching: bool = True
    """Reuse cached pages (compressed entries, indexer keys, compressor carry) of a shared
    prompt prefix; the sliding window is rebuilt by SWA bounded replay."""
    replay_tail: int | None = None
    """Tokens recomputed before a prefix-cache hit to rebuild the sliding windows; ``None`` =
    the exact V4 bound ``align(align(W, page) + (N-1)*W, page)``."""
    async_scheduling: bool = True
    """Schedule and prepare step N+1 while step N runs; outputs lag one step."""
    batch_invariant: bool = False
    """Make a request's logits and logprobs bitwise independent of the rest of the batch and of
    the prefill chunk size (slower: fixed-shape tiles for every reduction)."""
    scheduler: str = "fcfs"
    """Request scheduler by registered name (``deepinfer_register_schedulers``); the core's
    ``fcfs`` admits waiting requests first come, first served, preempting the newest."""
    enforce_eager: bool = False
    """Never capture device graphs: run every step eagerly.  By default a backend that supports
    graph capture on a device with a graph runtime (CUDA) runs decode steps as graphs."""
    mixed_graph_max_tokens: int = 512
    """Also capture graphs of *mixed* steps (prefill chunks beside decodes, e.g. a finished
    request's successor admitted into a running batch) of up to this many tokens, one per
    power-of-two token bucket from 64, each padded to ``max_num_seqs`` requests; such a step
    otherwise runs eagerly (on the H200, ~25 ms against ~7 ms for a replayed decode step of the
    V4-Flash-width benchmark model; with speculative decoding, which desynchronises requests,
    the graphs took B=16/64 throughput up 16 % with `fixed` and 13-34 % with DSpark:
    docs/benchmarks.md).  Buckets: 64, 128, ... below this bound (and the step's token budget),
    and the bound itself.  ``0`` = off.  Only where decode graphs are captured; not with a
    distributed run (those steps stay eager)."""
    keep_quantized: bool | None = None
    """Keep the checkpoint's quantised weights quantised in device memory (FP8 e4m3 dense weights
    with 128x128 block scales, FP4 e2m1 experts with one scale per 32 inputs) and hand them to the
    ops as ``QuantizedTensor``; ``False`` dequantises them at load to ``dtype``.  ``None`` = keep
    the formats the backend declares in ``BackendSpec.quantized_weights`` (none for the
    reference, which dequantises per call when this is ``True``)."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (:class:`SpeculativeConfig`, or a dict / JSON object of its fields;
    ``DEEPINFER_USE_NEXTN_DECODE=N`` turns it on with ``max_draft_tokens=N``); ``None`` = off."""
    data_parallel_size: int = 1
    """Attention data-parallel replicas: each rank runs its own scheduler (prefix cache, async
    scheduling, preemption) over the requests it is given; ``LLM`` on one host starts one worker
    process per extra rank, ``torchrun -m deepinfer_core.launch`` runs it across hosts."""
    enable_expert_parallel: bool = False
    """Shard the routed experts over every rank (expert parallelism; each rank loads only its
    experts) instead of replicating them; tokens go to their experts' ranks and back by the
    ``moe_dispatch`` / ``moe_combine`` ops."""
    context_parallel_size: int = 1
    """Ranks per data-parallel replica that share its long prefills (balanced context
    parallelism: the chunk split into ``2 * C`` zig-zag pieces); world size =
    ``data_parallel_size * context_parallel_size``."""
    context_parallel_min_tokens: int | None = None
    """The shortest prefill chunk a context-parallel group splits over its ranks (shorter ones
    are computed by every rank); ``None`` = ``$DEEPINFER_CP_MIN_TOKENS`` or the default 1024
    (:func:`deepinfer_core.models.context_parallel.cp_min_tokens`)."""
    distributed_backend: Literal["auto", "gloo", "nccl", "hccl"] = "auto"
    """``torch.distributed`` backend of the device collectives; ``auto`` = ``nccl`` on CUDA,
    ``hccl`` on Ascend, ``gloo`` on CPU."""
    distributed_timeout_s: float = 600.0
    """Seconds a collective may wait (a rank that died or hangs) before the run ends with an
    error naming the rank."""
    device_timeout_s: float = 600.0
    """Seconds the engine waits for a step's results from the device (its sampled tokens, or a
    verify step's target tokens) before the run ends with a ``DeviceTimeoutError`` saying so (a
    hung kernel or device); ``0`` = wait as long as it takes."""
    eplb: EPLBConfig | None = None
    """Expert-parallel load balancing (:class:`EPLBConfig`, or a dict / JSON object of its
    fields); ``None`` = off.  Needs ``enable_expert_parallel``."""
    log_level: LogLevel = "warning"
    """Level of the ``deepinfer`` logger."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(format_errors(e, data, _ORIGIN.get() or {})) from None

    @field_validator(
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "page_size",
        "num_cache_pages",
        "replay_tail",
        "data_parallel_size",
        "context_parallel_size",
        "context_parallel_min_tokens",
    )
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be >= 1")
        if value is not None and value >= MAX_INT_OPTION:
            raise ValueError(f"must be < 2**31 ({MAX_INT_OPTION})")
        return value

    @field_validator("mixed_graph_max_tokens")
    @classmethod
    def _non_negative(cls, value: int) -> int:
        if not 0 <= value < MAX_INT_OPTION:
            raise ValueError(f"must be >= 0 (0 = off) and < 2**31 ({MAX_INT_OPTION})")
        return value

    @field_validator("device_timeout_s")
    @classmethod
    def _non_negative_float(cls, value: float) -> float:
        if not value >= 0 or value == float("inf"):
            raise ValueError("must be >= 0 (0 = no limit) and finite")
        return value

    @field_validator("kv_cache_memory_gb", "distributed_timeout_s")
    @classmethod
    def _positive_float(cls, value: float | None) -> float | None:
        if value is not None and not value > 0:
            raise ValueError("must be > 0")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int) -> int:
        if not 0 <= value < 2**63:
            raise ValueError("must be in [0, 2**63)")
        return value

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        if not value:
            raise ValueError("must be 'auto', 'reference' or a registered backend name")
        return value

    @field_validator("scheduler")
    @classmethod
    def _scheduler(cls, value: str) -> str:
        if not value:
            raise ValueError("must be a registered scheduler name ('fcfs' is the core's)")
        return value

    @field_validator("speculative", "eplb", mode="before")
    @classmethod
    def _speculative(cls, value: Any) -> Any:
        if isinstance(value, str):  # an environment variable or a CLI flag: a JSON object
            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as e:
                raise ValueError(f"expected a JSON object of the option's fields ({e})") from None
        return value

    @property
    def num_spec_tokens(self) -> int:
        """Most draft tokens of a verify step (0 without speculative decoding): the cache keeps
        that many extra rows so a rejected draft leaves no trace."""
        return self.speculative.max_draft_tokens if self.speculative is not None else 0

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"with enable_chunked_prefill=False, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}) so that any prompt fits one step"
            )
        if self.eplb is not None and not self.enable_expert_parallel:
            raise ValueError("eplb needs enable_expert_parallel=True (it balances experts over the EP ranks)")
        return self

    @property
    def world_size(self) -> int:
        """Processes of a distributed run: ``data_parallel_size * context_parallel_size``."""
        return self.data_parallel_size * self.context_parallel_size

    # ---- derived values, resolved against the model and the backend ----------------------
    def resolved_max_model_len(self, max_position_embeddings: int) -> int:
        """``max_model_len``, defaulted and checked against the model's positions."""
        if self.max_model_len is None:
            return min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > max_position_embeddings:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{max_position_embeddings}; lower max_model_len"
            )
        return self.max_model_len

    def resolved_page_size(self, compress_ratios: Iterable[int]) -> int:
        """``page_size``, defaulted to the smallest multiple of 16 and of every (non-zero) compress
        ratio, and checked to be a multiple of each ratio (a page must hold whole compressed entries)."""
        ratios = sorted({int(r) for r in compress_ratios if r})
        if self.page_size is None:
            return math.lcm(PAGE_SIZE_QUANTUM, *ratios)
        bad = [r for r in ratios if self.page_size % r]
        if bad:
            raise ConfigError(
                f"page_size={self.page_size} is not a multiple of the model's compress ratios {bad}; "
                f"use a multiple of {math.lcm(*ratios)}"
            )
        return self.page_size

    def resolved_quantized_formats(self, backend_formats: Iterable[str] = ()) -> tuple[str, ...]:
        """The weight formats to keep quantised: every one the loader can keep when
        ``keep_quantized`` is ``True``, none when ``False``, the backend's declared
        ``quantized_weights`` (``backend_formats``) when ``None``."""
        if self.keep_quantized is None:
            return tuple(f for f in QUANTIZED_FORMATS if f in set(backend_formats))
        return QUANTIZED_FORMATS if self.keep_quantized else ()

    def resolved_dtype(self, device_type: str) -> str:
        """The concrete dtype: ``auto`` is float32 on ``cpu``, bfloat16 elsewhere."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if device_type == "cpu" else "bfloat16"

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        config_file: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> EngineConfig:
        """Merge defaults < ``config_file`` < ``DEEPINFER_*`` in ``env`` < ``overrides``.

        Args:
            config_file: a ``.toml``, ``.yaml`` or ``.yml`` file of top-level keys.
            env: environment to read ``DEEPINFER_*`` variables from (default ``os.environ``).
            overrides: field values; ``None`` values are ignored (treated as not given).

        Raises:
            ConfigError: unknown key, unreadable file, or invalid value — naming the field and source.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        origin: dict[str, str] = {}
        if config_file is not None:
            for key, value in read_config_file(config_file).items():
                values[key], origin[key] = value, f"config file {config_file}"
        for key, (value, var) in env_values(env, cls.model_fields).items():
            values[key], origin[key] = value, f"environment variable {var}"
        apply_nextn_env(env, values, origin)
        for key, value in overrides.items():
            if value is None:
                continue
            if key not in cls.model_fields:
                hint = did_you_mean(key, cls.model_fields) or f"; known options: {sorted(cls.model_fields)}"
                raise ConfigError(f"unknown engine option {key!r}{hint}")
            values[key], origin[key] = value, "argument"
        apply_varlen_env(env, values, origin)
        return cls.validated(values, origin)

    @classmethod
    def validated(cls, values: Mapping[str, Any], origin: Mapping[str, str] | None = None) -> EngineConfig:
        """Validate ``values``, turning pydantic errors into a :class:`ConfigError` naming each
        bad field and (via ``origin``: field -> description) where its value came from."""
        token = _ORIGIN.set(dict(origin or {}))
        try:
            return cls(**values)
        finally:
            _ORIGIN.reset(token)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML or YAML engine config file; unknown keys are an error naming key and file."""
    return read_options_file(path, EngineConfig.model_fields)
