"""The tensor inventories of released DeepSeek checkpoints, rebuilt from their ``config.json``.

Written for the tests from published facts about the checkpoints (their shard headers' names,
dtypes and shapes as public inventories list them, and the model code that reads them), not from
the engine's parameter tables, so a test can hold the engine's loaders against them.  A
checkpoint is ``{name: (safetensors dtype, shape)}``; :func:`write_headers` turns one into a
directory of header-only shards (no tensor data) with an index, which the loaders' ``check_*``
functions read as they read a real download.

- DeepSeek-V4 (``v4_inventory``): native names; dense linears e4m3 with ue8m0 scales per
  ``weight_block_size`` tile (``X.scale``), routed experts packed e2m1 in ``I8`` (two values a
  byte) with a ue8m0 scale per 32 inputs; ``BF16`` norms, embedding and head; ``F32`` mHC,
  sinks, router biases and compressor position biases; hash layers route by an ``I64``
  ``tid2eid`` table and have no router bias; the multi-token-prediction layer ``mtp.0`` is a
  sliding-window block with ``enorm``/``hnorm``/``e_proj``/``h_proj``, its own ``norm`` and
  ``hc_head_*`` (the embedding and head are the model's).  V4-Flash has 69,187 tensors.
- DeepSeek-V4.1 (``v41_inventory``): the same conventions (32x32 tiles); the causal
  encoder-decoder's compressors and indexers only on the kv / index source layers, Engram tables
  (e4m3 rows, a ue8m0 scale per 32 channels) on ``engram_layer_ids``, every router with an
  image-token bias ``bias_vl``; the DSpark drafter's stages ``mtp.{j}`` (window blocks with
  ``dspark_n_routed_experts`` experts), the combiner under stage 0 and the head stack under the
  last stage.  The vision tower and image embeddings are represented by one stand-in tensor per
  part (their real names are many; the text loaders skip the parts by prefix).
- DeepSeek-V4-Flash-0731 (``v4_dspark_inventory``): V4-Flash's main model; its ``mtp.*`` hold
  DSpark block-drafter stages instead of an MTP layer (one V4 sliding block per trailing
  ``compress_ratios`` entry, the combiner ``main_proj``/``main_norm`` under stage 0, ``norm``,
  the Markov and confidence heads and ``hc_head_*`` under the last stage, as vLLM-Ascend's V4
  DSpark loader reads them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from math import ceil
from pathlib import Path
from typing import Any

Inventory = dict[str, tuple[str, tuple[int, ...]]]

_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I64": 8}


def _text(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config", config)


class _Builder:
    def __init__(self, config: dict[str, Any]):
        self.c = _text(config)
        quant = config.get("quantization_config") or {}
        self.block = tuple(quant.get("weight_block_size") or (128, 128))
        self.inv: Inventory = {}

    def add(self, name: str, dtype: str, *shape: int) -> None:
        assert name not in self.inv, name
        self.inv[name] = (dtype, tuple(shape))

    def fp8(self, stem: str, rows: int, cols: int) -> None:
        """A dense linear: e4m3 weight, ue8m0 scale per block tile."""
        self.add(stem + ".weight", "F8_E4M3", rows, cols)
        self.add(stem + ".scale", "F8_E8M0", ceil(rows / self.block[0]), ceil(cols / self.block[1]))

    def fp4(self, stem: str, rows: int, cols: int) -> None:
        """A routed expert's projection: e2m1 packed two a byte, ue8m0 scale per 32 inputs."""
        self.add(stem + ".weight", "I8", rows, cols // 2)
        self.add(stem + ".scale", "F8_E8M0", rows, cols // 32)

    def attention(self, a: str) -> None:
        """The projections every V4 / V4.1 attention has (prefix ``...attn.``)."""
        c = self.c
        D, H, hd, ql = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
        G, ol = c["o_groups"], c["o_lora_rank"]
        self.fp8(a + "wq_a", ql, D)
        self.fp8(a + "wq_b", H * hd, ql)
        self.fp8(a + "wkv", hd, D)
        self.fp8(a + "wo_a", G * ol, H * hd // G)
        self.fp8(a + "wo_b", D, G * ol)
        self.add(a + "q_norm.weight", "BF16", ql)
        self.add(a + "kv_norm.weight", "BF16", hd)
        self.add(a + "attn_sink", "F32", H)

    def moe(self, f: str, experts: int, router_bias: bool = True, tid2eid: bool = False, image: bool = False):
        c = self.c
        D, inter = c["hidden_size"], c["moe_intermediate_size"]
        self.add(f + "gate.weight", "BF16", experts, D)
        if router_bias:
            self.add(f + "gate.bias", "F32", experts)
        if image:
            self.add(f + "gate.bias_vl", "F32", experts)
        if tid2eid:
            self.add(f + "gate.tid2eid", "I64", c["vocab_size"], c["num_experts_per_tok"])
        for e in range(experts):
            self.fp4(f"{f}experts.{e}.w1", inter, D)
            self.fp4(f"{f}experts.{e}.w3", inter, D)
            self.fp4(f"{f}experts.{e}.w2", D, inter)
        self.fp8(f + "shared_experts.w1", inter, D)
        self.fp8(f + "shared_experts.w3", inter, D)
        self.fp8(f + "shared_experts.w2", D, inter)

    def block_rest(self, p: str) -> None:
        """Norms and mHC of a block (prefix ``layers.{i}.`` / ``mtp.{j}.``)."""
        D, N = self.c["hidden_size"], self.c["hc_mult"]
        self.add(p + "attn_norm.weight", "BF16", D)
        self.add(p + "ffn_norm.weight", "BF16", D)
        for site in ("attn", "ffn"):
            self.add(f"{p}hc_{site}_fn", "F32", (2 + N) * N, N * D)
            self.add(f"{p}hc_{site}_base", "F32", (2 + N) * N)
            self.add(f"{p}hc_{site}_scale", "F32", 3)

    def dspark_ends(self, stages: int, targets: int, rank: int, confidence: str) -> str:
        """The DSpark drafter's first-stage input (``main_proj`` over ``targets`` hidden states,
        ``main_norm``) and its last stage's norm, Markov head and confidence head (named
        ``confidence``); returns the last stage's prefix."""
        d, v = self.c["hidden_size"], self.c["vocab_size"]
        self.add("mtp.0.main_proj.weight", "BF16", d, targets * d)
        self.add("mtp.0.main_norm.weight", "BF16", d)
        last = f"mtp.{stages - 1}."
        self.add(last + "norm.weight", "BF16", d)
        self.add(last + "markov_head.embed.weight", "BF16", v, rank)
        self.add(last + "markov_head.head.weight", "F32", v, rank)
        self.add(last + confidence, "F32", 1, d + rank)
        return last

    def hc_head(self, p: str) -> None:
        D, N = self.c["hidden_size"], self.c["hc_mult"]
        self.add(p + "hc_head_fn", "F32", N, N * D)
        self.add(p + "hc_head_base", "F32", N)
        self.add(p + "hc_head_scale", "F32", 1)

    def top(self, hc_head: bool) -> None:
        c = self.c
        V, D = c["vocab_size"], c["hidden_size"]
        self.add("embed.weight", "BF16", V, D)
        self.add("head.weight", "BF16", V, D)
        self.add("norm.weight", "BF16", D)
        if hc_head:
            self.hc_head("")

    # ---- DeepSeek-V4 ----------------------------------------------------------------------
    def v4_layer(self, p: str, ratio: int, hash_layer: bool) -> None:
        c = self.c
        D, hd, ql = c["hidden_size"], c["head_dim"], c["q_lora_rank"]
        ih, ihd = c["index_n_heads"], c["index_head_dim"]
        a = p + "attn."
        self.attention(a)
        if ratio:
            coff = 2 if ratio == 4 else 1  # the ratio-4 (CSA) compressor keeps two overlapping series
            self.add(a + "compressor.wkv.weight", "BF16", coff * hd, D)
            self.add(a + "compressor.wgate.weight", "BF16", coff * hd, D)
            self.add(a + "compressor.ape", "F32", ratio, coff * hd)
            self.add(a + "compressor.norm.weight", "BF16", hd)
        if ratio == 4:
            x = a + "indexer."
            self.fp8(x + "wq_b", ih * ihd, ql)
            self.add(x + "weights_proj.weight", "BF16", ih, D)
            self.add(x + "compressor.wkv.weight", "BF16", 2 * ihd, D)
            self.add(x + "compressor.wgate.weight", "BF16", 2 * ihd, D)
            self.add(x + "compressor.ape", "F32", ratio, 2 * ihd)
            self.add(x + "compressor.norm.weight", "BF16", ihd)
        self.moe(p + "ffn.", c["n_routed_experts"], router_bias=not hash_layer, tid2eid=hash_layer)
        self.block_rest(p)


def v4_main(config: dict[str, Any]) -> _Builder:
    b = _Builder(config)
    c = b.c
    b.top(hc_head=True)
    for i in range(c["num_hidden_layers"]):
        b.v4_layer(f"layers.{i}.", c["compress_ratios"][i], i < c.get("num_hash_layers", 3))
    return b


def v4_inventory(config: dict[str, Any]) -> Inventory:
    """A DeepSeek-V4 checkpoint: the main model and its multi-token-prediction layers."""
    b = v4_main(config)
    c = b.c
    D, L = c["hidden_size"], c["num_hidden_layers"]
    for j in range(c.get("num_nextn_predict_layers", 1)):
        p = f"mtp.{j}."
        b.v4_layer(p, c["compress_ratios"][L + j], hash_layer=False)
        b.add(p + "enorm.weight", "BF16", D)
        b.add(p + "hnorm.weight", "BF16", D)
        b.fp8(p + "e_proj", D, D)
        b.fp8(p + "h_proj", D, D)
        b.add(p + "norm.weight", "BF16", D)
        b.hc_head(p)
    return b.inv


def v4_dspark_inventory(config: dict[str, Any]) -> Inventory:
    """A DeepSeek-V4 checkpoint whose ``mtp.*`` are DSpark block-drafter stages (V4-Flash-0731)."""
    b = v4_main(config)
    c = b.c
    L = c["num_hidden_layers"]
    r, ids = c["dspark_markov_rank"], c["dspark_target_layer_ids"]
    stages = len(c["compress_ratios"]) - L
    for j in range(stages):
        b.v4_layer(f"mtp.{j}.", c["compress_ratios"][L + j], hash_layer=False)
    last = b.dspark_ends(stages, len(ids), r, "confidence_head.proj.weight")
    b.hc_head(last)
    return b.inv


# ---- DeepSeek-V4.1 ------------------------------------------------------------------------------
def v41_inventory(config: dict[str, Any]) -> Inventory:
    """A DeepSeek-V4.1 checkpoint: the text model, its Engram tables, the DSpark drafter, and one
    stand-in tensor for each part the text model does not serve."""
    b = _Builder(config)
    c = b.c
    D, N, L = c["hidden_size"], c["hc_mult"], c["num_hidden_layers"]
    hd, ql, ih, ihd = c["head_dim"], c["q_lora_rank"], c["index_n_heads"], c["index_head_dim"]
    ratios, kv, ix = c["compress_ratios"], c["kv_source_layer_ids"], c["index_source_layer_ids"]
    b.top(hc_head=False)
    for i in range(L):
        p = f"layers.{i}."
        a = p + "attn."
        b.attention(a)
        if i in kv:
            if ratios[i] > 1:  # pooled: float, with a softmax gate
                b.add(a + "compressor.wkv.weight", "F32", hd, D)
                b.add(a + "compressor.wgate.weight", "BF16", hd, D)
            else:  # ratio 1: a plain projection
                b.fp8(a + "compressor.wkv", hd, D)
            b.add(a + "compressor.norm.weight", "BF16", hd)
        if i in ix:
            b.fp8(a + "indexer.wq_b", ih * ihd, ql)
            b.add(a + "indexer.weights_proj.weight", "BF16", ih, D)
            if i in kv:  # the source derives its group's indexer keys
                b.fp8(a + "indexer.wk", ihd, hd)
                b.add(a + "indexer.k_norm.weight", "BF16", ihd)
        if i in c["engram_layer_ids"]:
            e = p + "engram."
            rows = c["engram_num_embeddings"][c["engram_layer_ids"].index(i)]
            width, cols = c["engram_head_dim"], (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"]
            b.add(e + "embed.weight", "F8_E4M3", rows, width)
            b.add(e + "embed.scale", "F8_E8M0", rows, width // 32)
            b.fp8(e + "wkv", (N + 1) * D, cols * width)
            b.add(e + "q_weight", "F32", N, D)
            b.add(e + "k_weight", "F32", N, D)
        b.moe(p + "ffn.", c["n_routed_experts"], image=True)
        b.block_rest(p)
    m = c["num_nextn_predict_layers"]
    r = c["dspark_markov_rank"]
    for j in range(m):
        p = f"mtp.{j}."
        b.attention(p + "attn.")
        b.moe(p + "ffn.", c["dspark_n_routed_experts"], image=True)
        b.block_rest(p)
    b.dspark_ends(m, len(c["dspark_target_layer_ids"]), r, "confidence_head.weight")
    vision = config.get("vision_config") or {}
    b.add(
        "vision.blocks.0.attn.qkv.weight",
        "BF16",
        3 * vision.get("hidden_size", 1024),
        vision.get("hidden_size", 1024),
    )
    b.add("aligner.proj.weight", "BF16", D, vision.get("hidden_size", 1024))
    for part in ("image_start", "image_end", "image_newline"):
        b.add(part, "BF16", D)
    return b.inv


# ---- header-only checkpoints ---------------------------------------------------------------------
def _shards(names: list[str], count: int) -> Iterator[list[str]]:
    per = ceil(len(names) / count)
    for s in range(0, len(names), per):
        yield names[s : s + per]


def write_headers(out: Path, config_file: Path, inventory: Inventory, shards: int = 8) -> Path:
    """A checkpoint directory of ``inventory``'s tensors as header-only safetensors shards (each
    header complete: dtypes, shapes, data offsets; no tensor data), their
    ``model.safetensors.index.json``, and ``config_file`` copied byte for byte."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_bytes(config_file.read_bytes())
    names = list(inventory)
    files = list(_shards(names, shards))
    weight_map: dict[str, str] = {}
    for k, part in enumerate(files):
        file = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in part:
            dtype, shape = inventory[name]
            size = _BYTES[dtype]
            for d in shape:
                size *= d
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = file
        raw = json.dumps(header).encode()
        (out / file).write_bytes(len(raw).to_bytes(8, "little") + raw)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out
