"""A tiny, random DeepSeek-V4 checkpoint for tests, examples and CPU benchmarks.

:data:`TINY_CONFIG` covers every layer type (sliding, CSA, HCA), both MoE kinds (hash
and top-k routed) and one multi-token-prediction layer (the ``mtp`` drafter's) at a size
that runs in milliseconds on a CPU.  :func:`make_tiny` writes a complete checkpoint
directory — config, random weights, a byte-level BPE tokenizer trained on a built-in corpus,
tokenizer and generation configs — deterministically from a seed, and
:func:`builtin_tiny_model_dir` caches one on disk.  Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from deepinfer_core.errors import ConfigError
from deepinfer_core.weights.writer import set_ordinary_mode

from . import writer
from .config import CSA, HCA, SLIDING, DeepseekV4Config
from .params import MTP_SHARED, ParamSpec, mtp_parameter_specs, parameter_specs, target_dtype
from .writer import save_checkpoint

logger = logging.getLogger("deepinfer.model")

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)  # ids 0..3, in this order

# DeepSeek-style: BOS, optional system text, then User/Assistant turns; EOS closes each answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}" + USER_TOKEN + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT_TOKEN + "{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT_TOKEN + "{% endif %}"
)

TINY_VOCAB_SIZE = 512
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "q_lora_rank": 32,
    "partial_rotary_factor": 0.25,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "compress_rates": {CSA: 4, HCA: 16},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "sliding_window": 8,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 8,  # >= 8: with fewer heads the indexer's top-k scores tie too often
    "index_head_dim": 16,
    "index_topk": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1024,  # = factor * original, as YaRN expects
    "num_nextn_predict_layers": 1,  # one MTP layer (sliding window), sharing embedding and head
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

_CORPUS_PATH = Path(__file__).with_name("tiny_corpus.txt")
# Bump when the output of make_tiny changes for reasons the source hash cannot see.
_FORMAT_VERSION = 1


# ---- tokenizer -----------------------------------------------------------------------------
def train_tokenizer(vocab_size: int = TINY_VOCAB_SIZE, lines: Iterable[str] | None = None) -> Tokenizer:
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens on ``lines`` (default: the
    built-in corpus's), deterministically.

    Special tokens take ids 0..3 in :data:`SPECIAL_TOKENS` order; the post-processor
    prepends BOS when encoding with ``add_special_tokens=True``, as DeepSeek's does.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if lines is None:
        lines = _CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, 0)]
    )
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    return tok


def write_tokenizer_files(outdir: str | Path) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer().save(str(out / "tokenizer.json"))
    write_tokenizer_configs(out, TINY_CONFIG)
    return out


def write_tokenizer_configs(out: Path, config: dict[str, Any]) -> None:
    """Write ``tokenizer_config.json`` (the DeepSeek chat template, BOS / EOS) and
    ``generation_config.json`` for a model of ``config`` (its special ids and positions)."""
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    gen_cfg = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "do_sample": False,
    }
    _write_json(out / "tokenizer_config.json", tok_cfg)
    _write_json(out / "generation_config.json", gen_cfg)


# ---- weights -------------------------------------------------------------------------------
def random_weights(
    cfg: DeepseekV4Config, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Random weights for every entry of :func:`parameter_specs`, by HF name, then those of the
    multi-token-prediction layers (:func:`mtp_parameter_specs`) except their own embedding and
    head (:data:`MTP_SHARED`: the MTP layers share the main model's).

    Each tensor has its own generator seeded from ``seed`` and its name, so adding a
    parameter never changes the others.  Scales keep activations O(1) and spread the
    logits (standard deviation ~1) so greedy decoding is not decided by near-ties.
    """
    out: dict[str, torch.Tensor] = {}
    mtp = {n: s for n, s in mtp_parameter_specs(cfg).items() if not n.endswith(MTP_SHARED)}
    for name, spec in {**parameter_specs(cfg), **mtp}.items():
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        out[name] = _init_param(name, spec, cfg, g).to(target_dtype(spec, dtype)).contiguous()
    return out


def _init_param(name: str, spec: ParamSpec, cfg: DeepseekV4Config, g: torch.Generator) -> torch.Tensor:
    shape = spec.shape

    def noise(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    leaf = name.rsplit(".", 1)[-1]
    if spec.kind == "int":  # tid2eid: k distinct experts per token
        k = shape[1]
        return torch.rand(shape[0], cfg.n_routed_experts, generator=g).argsort(dim=-1)[:, :k]
    if spec.kind == "embedding":
        return noise(1.0)
    if spec.kind in ("linear", "linear_bf16", "experts"):
        return noise(shape[-1] ** -0.5)  # fan-in scaling
    if leaf == "weight":  # RMSNorm gains
        return 1.0 + noise(0.05)
    if leaf in ("fn", "hc_fn"):
        return noise(0.02)
    if leaf in ("base", "hc_base"):
        return noise(0.1)
    if leaf in ("scale", "hc_scale"):
        return 1.0 + noise(0.1)
    if leaf in ("sinks", "position_bias"):
        return noise(0.1)
    if leaf == "e_score_correction_bias":
        return noise(0.01)
    raise ValueError(f"tiny init has no rule for fp32 parameter {name}")


# ---- checkpoint ----------------------------------------------------------------------------
def make_tiny(
    outdir: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    config: dict[str, Any] | None = None,
    **save_options: Any,
) -> Path:
    """Write a complete tiny DeepSeek-V4 checkpoint to ``outdir`` and return its path.

    Same arguments give byte-identical files.  ``config``: keys replacing those of
    :data:`TINY_CONFIG` (e.g. the head widths a backend's kernels take).  ``save_options`` go to
    :func:`deepinfer_core.models.deepseek_v4.writer.save_checkpoint` (``names="native"``,
    ``fp8_linear``, ``fp4_experts``, ``max_shard_bytes``, ...).  With the defaults the
    directory loads both in DeepInfer and in ``transformers.DeepseekV4ForCausalLM``.
    """
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = {**TINY_CONFIG, **(config or {})}
    cfg = DeepseekV4Config.from_dict(cfg_dict, source="TINY_CONFIG" if config is None else "tiny config")
    write_tokenizer_files(out)
    weights = random_weights(cfg, seed, dtype)
    save_checkpoint(weights, {**cfg_dict, "dtype": _dtype_name(dtype)}, out, **save_options)
    return out


CACHE_ENV = "DEEPINFER_CACHE"
CACHED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
"""The files of a cached built-in tiny model (what :func:`make_tiny` writes)."""


def builtin_tiny_model_dir(seed: int = 0) -> Path:
    """The built-in tiny model directory, created on first use and cached.

    Lives under ``$DEEPINFER_CACHE`` (default ``~/.cache/deepinfer``) in a folder named
    after a hash of the config, seed and generating code, so a code change makes a new one.
    Built in a temporary sibling and renamed into place, so concurrent callers are safe.  A
    cached folder that is damaged (a file missing, ``config.json`` unreadable, the safetensors
    file truncated or not safetensors) is rebuilt, with a warning.  Folders and files get the
    permissions of any new file (``0755`` / ``0644`` under the usual umask).

    Raises:
        ConfigError: the folder cannot be built there (naming it, and ``DEEPINFER_CACHE``).
    """
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "deepinfer")
    final = root / f"tiny-v4-{_cache_key(seed)}"
    damage = cache_damage(final)
    if damage is None:
        return final
    if final.exists():
        logger.warning("the cached built-in tiny model %s is damaged (%s); rebuilding it", final, damage)
    try:
        _build_into(root, final, seed)
    except OSError as e:
        what = (
            f"rebuild the damaged ({damage}) built-in tiny model"
            if final.exists()
            else "build the built-in tiny model"
        )
        raise ConfigError(
            f"cannot {what} in {final} ({e.strerror or e}); remove that folder, or set {CACHE_ENV} to a "
            "writable directory"
        ) from None
    return final


def _build_into(root: Path, final: Path, seed: int) -> None:
    """Make the tiny model in a temporary sibling of ``final`` and rename it into place; a
    damaged ``final`` is moved aside (and removed) first, a complete one (a concurrent
    caller's) is kept."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=root))
    aside = None
    try:
        make_tiny(tmp, seed=seed)
        set_ordinary_mode(tmp)  # mkdtemp made it 0700
        try:
            os.rename(tmp, final)
        except OSError:
            if cache_damage(final) is None:  # a concurrent caller's complete folder
                return
            aside = Path(tempfile.mkdtemp(prefix=final.name + ".damaged-", dir=root))
            os.rename(final, aside / "model")  # atomic: nobody sees a half-removed folder
            os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def cache_damage(model_dir: Path) -> str | None:
    """Why ``model_dir`` is not a complete tiny model (``"missing"`` when absent), else ``None``:
    a file of :data:`CACHED_FILES` missing, ``config.json`` not a JSON object, the safetensors
    file unreadable (truncated, not safetensors: its header and size are checked, not its data)."""
    if not model_dir.is_dir():
        return "missing"
    missing = [name for name in CACHED_FILES if not (model_dir / name).is_file()]
    if missing:
        return f"no {', '.join(missing)}"
    try:
        if not isinstance(json.loads((model_dir / "config.json").read_text(encoding="utf-8")), dict):
            return "config.json is not a JSON object"
    except (OSError, ValueError) as e:
        return f"config.json unreadable: {e}"
    try:
        with safe_open(str(model_dir / "model.safetensors"), framework="pt"):
            pass
    except Exception as e:  # safetensors raises its own SafetensorError, or OSError
        return f"model.safetensors unreadable: {e}"
    return None


def _cache_key(seed: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(TINY_CONFIG, sort_keys=True).encode())
    versions = f"torch={torch.__version__};tokenizers={tokenizers.__version__}"
    h.update(f"seed={seed};format={_FORMAT_VERSION};{versions}".encode())
    for path in (Path(__file__), _CORPUS_PATH, Path(__file__).with_name("params.py"), Path(writer.__file__)):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
