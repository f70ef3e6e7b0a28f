"""The parameter inventory of DeepSeek-V4.1's text backbone, by native checkpoint name.

The single source of truth of the loader (names, shapes, dtypes), ``make-tiny --arch
deepseek_v41`` and the model.  Names are the released checkpoint's (no ``model.`` prefix):
``embed.weight``, ``head.weight``, ``norm.weight`` and per layer ``layers.{i}.attn.*``,
``layers.{i}.ffn.*``, ``layers.{i}.attn_norm.weight`` / ``ffn_norm.weight`` and the mHC
parameters ``layers.{i}.hc_attn_{fn,base,scale}`` / ``hc_ffn_*``.  The routed experts are
stored per expert (``layers.{i}.ffn.experts.{e}.w1|w2|w3.weight``); the model holds them
stacked as the core ``moe_experts`` op takes them, under the inventory names
``layers.{i}.ffn.experts.gate_up`` ``[E, 2I, D]`` (``w1`` rows then ``w3`` rows) and
``layers.{i}.ffn.experts.down`` ``[E, D, I]`` (:data:`EXPERT_STACKS`).

An Engram layer also has ``layers.{i}.engram.embed.weight`` (the table, ``engram_num_embeddings``
rows of ``engram_head_dim``; e4m3 with ``embed.scale`` per 32 channels in the release, kept so:
only looked-up rows are dequantised; transformers writes a float table with a float32
``embed.scale`` it applies to e4m3 rows only, and so does the loader), ``engram.wkv.weight`` and
``engram.q_weight`` / ``k_weight`` (transformers-main's module names).

A checkpoint written by transformers' ``save_pretrained`` has the same names behind a ``model.``
prefix, except the head (:data:`HF_ALIASES`).

The DSpark drafter's tensors (``mtp.{j}.*``, not loaded by the text model) are
:func:`dspark_parameter_specs`.

Which attention tensors a layer has follows the CED layout: every layer its window
projections; a kv source its compressor (``wgate`` only above ratio 1); an index source its
indexer queries (``wq_b``, ``weights_proj``), and a kv source's indexer also the key projection
(``wk``, ``k_norm``) its whole group scores against.
"""

from __future__ import annotations

from deepinfer_core.models.deepseek_v4.params import ParamSpec, target_dtype

from .config import DeepseekV41Config

__all__ = [
    "EXPERT_STACKS",
    "HF_ALIASES",
    "IGNORED_PREFIXES",
    "ParamSpec",
    "dspark_parameter_specs",
    "parameter_specs",
    "target_dtype",
]

EXPERT_STACKS = {"w1": ("gate_up", "gate"), "w3": ("gate_up", "up"), "w2": ("down", "down")}
"""Native per-expert projection -> (stacked inventory tensor, part): ``gate_up[e] = cat(w1, w3)``."""

IGNORED_PREFIXES = ("mtp.", "vision.", "aligner.", "image_start", "image_end", "image_newline")
"""Checkpoint tensors the text model does not load: the DSpark draft layers, the vision tower and
aligner, the image delimiter embeddings (as transformers' ``_keys_to_ignore_on_load_unexpected``);
also every ``ffn.gate.bias_vl`` (the router bias of image tokens)."""


HF_ALIASES = {"lm_head.weight": "head.weight"}
"""transformers' spellings (``DeepseekV41ForCausalLM.save_pretrained``) of tensors whose native
name differs: its output head is ``lm_head.weight``.  Every other tensor it writes has the native
name behind a ``model.`` prefix, which the loader strips."""


def is_image_router_bias(name: str) -> bool:
    """Whether ``name`` is a router's image-token bias (``ffn.gate.bias_vl``, of a main layer or
    a DSpark stage): text tokens never route with it, so no text part loads it."""
    return name.endswith(".gate.bias_vl")


def is_ignored(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is one the text model skips (:data:`IGNORED_PREFIXES`)."""
    bare = name.removeprefix("model.")
    return bare.startswith(IGNORED_PREFIXES) or is_image_router_bias(bare) or bare.endswith("inv_freq")


def parameter_specs(cfg: DeepseekV41Config) -> dict[str, ParamSpec]:
    """All parameters of the text model, in a stable order, keyed by inventory name."""
    D, V = cfg.hidden_size, cfg.vocab_size
    s: dict[str, ParamSpec] = {"embed.weight": ParamSpec((V, D), "embedding")}
    for i in range(cfg.num_hidden_layers):
        s.update(layer_specs(cfg, i))
    s["norm.weight"] = ParamSpec((D,), "fp32")
    s["head.weight"] = ParamSpec((V, D), "linear")
    return s


def window_layer_specs(cfg: DeepseekV41Config, prefix: str, n_experts: int) -> dict[str, ParamSpec]:
    """The parameters every V4.1 block has, under ``prefix`` (``layers.{i}.`` or ``mtp.{j}.``):
    the window attention's projections, norms and sinks, the MoE with ``n_experts`` routed
    experts (and one shared one), the two norms and the mHC mixes -- everything of a layer
    whose compress ratio is 0 and that has no Engram (a DSpark draft layer)."""
    D, N = cfg.hidden_size, cfg.hc_mult
    H, hd, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, ol = cfg.o_groups, cfg.o_lora_rank
    inter = cfg.moe_intermediate_size
    a, f = prefix + "attn.", prefix + "ffn."
    s: dict[str, ParamSpec] = {
        a + "wq_a.weight": ParamSpec((ql, D), "linear"),
        a + "q_norm.weight": ParamSpec((ql,), "fp32"),
        a + "wq_b.weight": ParamSpec((H * hd, ql), "linear"),
        a + "wkv.weight": ParamSpec((hd, D), "linear"),
        a + "kv_norm.weight": ParamSpec((hd,), "fp32"),
        a + "wo_a.weight": ParamSpec((G * ol, H * hd // G), "linear"),
        a + "wo_b.weight": ParamSpec((D, G * ol), "linear"),
        a + "attn_sink": ParamSpec((H,), "fp32"),
        f + "gate.weight": ParamSpec((n_experts, D), "linear_bf16"),
        f + "gate.bias": ParamSpec((n_experts,), "fp32"),
        f + "experts.gate_up": ParamSpec((n_experts, 2 * inter, D), "experts"),
        f + "experts.down": ParamSpec((n_experts, D, inter), "experts"),
        f + "shared_experts.w1.weight": ParamSpec((inter, D), "linear"),
        f + "shared_experts.w3.weight": ParamSpec((inter, D), "linear"),
        f + "shared_experts.w2.weight": ParamSpec((D, inter), "linear"),
        prefix + "attn_norm.weight": ParamSpec((D,), "fp32"),
        prefix + "ffn_norm.weight": ParamSpec((D,), "fp32"),
    }
    mix = (2 + N) * N
    for site in ("attn", "ffn"):
        s[prefix + f"hc_{site}_fn"] = ParamSpec((mix, N * D), "fp32")
        s[prefix + f"hc_{site}_base"] = ParamSpec((mix,), "fp32")
        s[prefix + f"hc_{site}_scale"] = ParamSpec((3,), "fp32")
    return s


def layer_specs(cfg: DeepseekV41Config, i: int) -> dict[str, ParamSpec]:
    """The parameters of decoder layer ``i`` (prefix ``layers.{i}.``)."""
    D, N = cfg.hidden_size, cfg.hc_mult
    hd, ql = cfg.head_dim, cfg.q_lora_rank
    ih, ihd = cfg.index_n_heads, cfg.index_head_dim
    p = f"layers.{i}."
    a = p + "attn."
    s = window_layer_specs(cfg, p, cfg.n_routed_experts)
    r = cfg.compress_ratio(i)
    if cfg.is_kv_source(i):
        c = a + "compressor."
        s[c + "wkv.weight"] = ParamSpec((hd, D), "linear_bf16" if r > 1 else "linear")
        if r > 1:
            s[c + "wgate.weight"] = ParamSpec((hd, D), "linear_bf16")
        s[c + "norm.weight"] = ParamSpec((hd,), "fp32")
    if cfg.is_index_source(i):
        x = a + "indexer."
        s[x + "wq_b.weight"] = ParamSpec((ih * ihd, ql), "linear")
        s[x + "weights_proj.weight"] = ParamSpec((ih, D), "linear_bf16")
        if cfg.is_kv_source(i):
            s[x + "wk.weight"] = ParamSpec((ihd, hd), "linear")
            s[x + "k_norm.weight"] = ParamSpec((ihd,), "fp32")
    if i in cfg.engram_layer_ids:
        e = p + "engram."
        rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(i)]
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        s[e + "embed.weight"] = ParamSpec((rows, cfg.engram_head_dim), "engram_table")
        s[e + "wkv.weight"] = ParamSpec(((N + 1) * D, cols * cfg.engram_head_dim), "linear")
        s[e + "q_weight"] = ParamSpec((N, D), "fp32")
        s[e + "k_weight"] = ParamSpec((N, D), "fp32")
    return s


CONFIDENCE_HEAD = "confidence_head.weight"
"""The confidence head's leaf under the last draft stage (vllm-ascend's reading); the loader also
accepts vLLM-nvidia's module path ``confidence_head.proj.weight`` (:data:`DSPARK_ALIASES`)."""
DSPARK_ALIASES = {"confidence_head.proj.weight": CONFIDENCE_HEAD}
"""Other checkpoint spellings of DSpark head leaves -> the inventory's."""
DSPARK_COMBINER = ("main_proj.weight", "main_norm.weight")
"""Leaves of the context combiner, held under stage 0 (the checkpoint may put them under any)."""
DSPARK_HEADS = ("norm.weight", "markov_head.embed.weight", "markov_head.head.weight", CONFIDENCE_HEAD)
"""Leaves of the head stack, held under the last stage (the checkpoint may put them under any)."""


def dspark_parameter_specs(cfg: DeepseekV41Config) -> dict[str, ParamSpec]:
    """The DSpark drafter's parameters (native names ``mtp.{j}.*``, ``j < num_nextn_predict_layers``):
    per stage a window-only block with ``dspark_n_routed_experts`` experts; the context combiner
    (``main_proj`` ``[D, |T_ids| D]`` BF16, ``main_norm``) under stage 0; the drafter's final norm,
    the Markov head (``embed`` ``[V, r]``, ``head`` ``[V, r]`` float32) and the confidence head
    (``[1, D + r]`` float32, optional: :func:`dspark_optional`) under the last stage.  The
    embedding and the output head are the target's."""
    D, V, r, m = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank, cfg.num_nextn_predict_layers
    s: dict[str, ParamSpec] = {}
    for j in range(m):
        s.update(window_layer_specs(cfg, f"mtp.{j}.", cfg.dspark_n_routed_experts))
    ids = cfg.dspark_target_layer_ids or []
    s["mtp.0.main_proj.weight"] = ParamSpec((D, len(ids) * D), "linear_bf16")
    s["mtp.0.main_norm.weight"] = ParamSpec((D,), "fp32")
    last = f"mtp.{m - 1}."
    s[last + "norm.weight"] = ParamSpec((D,), "fp32")
    s[last + "markov_head.embed.weight"] = ParamSpec((V, r), "embedding")
    s[last + "markov_head.head.weight"] = ParamSpec((V, r), "fp32")
    s[last + CONFIDENCE_HEAD] = ParamSpec((1, D + r), "fp32")
    return s


def dspark_optional(cfg: DeepseekV41Config) -> frozenset[str]:
    """DSpark parameters a checkpoint may lack: the confidence head (the drafter then reports no
    confidence and the engine falls back to running acceptance rates)."""
    return frozenset({f"mtp.{cfg.num_nextn_predict_layers - 1}.{CONFIDENCE_HEAD}"})
