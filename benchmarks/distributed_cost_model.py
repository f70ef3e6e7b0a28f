"""Scaling on paper: a per-step cost model of DeepSeek-V4 (and V3, for DeepSeek's published figures)
under Attention DP + MoE EP (+ EPLB redundancy) and context parallelism.

For one GPU of a ``world``-GPU deployment the model counts, per forward step:

* HBM bytes: the dense weights (replicated on every rank), the routed experts of this rank that
  the step's tokens actually reach (expected distinct experts: uniform routing, or a skewed
  popularity with or without an EPLB placement), the KV cache read (window 128 + compressed
  entries: CSA top-512 of the ratio-4 series and every indexer key, HCA every ratio-128 entry),
  and the mHC residual-stream traffic;
* FLOPs: dense matmuls (2 per weight per token), attention (QK and PV over the attended keys),
  the Lightning indexer's scores, and the experts (on the busiest rank);
* network bytes: MoE dispatch (FP8 rows + fp32 scales per 128) and combine (bf16 rows), top-k,
  split into what stays on the node (NVLink) and what leaves it (InfiniBand), plus the context-
  parallel exchange of window / compressed entries / indexer keys;

and turns them into a time per step in two ways: **sum** (nothing overlaps: HBM + FLOP + network
+ overhead) and **max** (perfect overlap, dual micro-batch: the largest of the three + overhead),
with a fixed per-step overhead (launches inside a CUDA graph, scheduler).  tokens/s per GPU =
tokens per GPU per step / time.

``python benchmarks/distributed_cost_model.py`` prints the V4-Flash scaling tables (decode on
1-64 H200s, prefill with and without CP) and writes ``benchmarks/results/distributed_cost_model.json``.
Equations, assumptions and the comparisons with measured figures: ``docs/distributed_cost_model.md``.
Pure Python (no torch): shapes come from
:class:`deepinfer_core.models.deepseek_v4.config.DeepseekV4Config`.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):  # the core, and _gpu_model beside this script
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from deepinfer_core.benchmarking.harness import print_table, write_json  # noqa: E402
from deepinfer_core.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "distributed_cost_model.json"


# ---- hardware ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuSpec:
    """Per-GPU ceilings used by the model (achievable figures, not datasheet peaks where measured).

    ``nvlink_bw`` / ``ib_bw``: bytes/s one GPU sends (and receives) on NVLink inside its node /
    on its own InfiniBand NIC to other nodes.  ``a2a_latency_s``: fixed cost of one dispatch or
    combine call (kernel launch, signalling, the slowest peer).  ``kernel_overhead_s``: cost of
    one kernel boundary inside a CUDA graph; ``step_overhead_s``: per step (scheduler, sampling).
    """

    name: str
    hbm_bw: float
    hbm_bytes: float
    flops_bf16: float
    flops_fp8: float
    nvlink_bw: float
    ib_bw: float
    gpus_per_node: int = 8
    a2a_latency_s: float = 25e-6
    kernel_overhead_s: float = 0.9e-6
    step_overhead_s: float = 50e-6

    def peak(self, math_kind: str) -> float:
        """FLOP/s of ``math_kind`` (``"bf16"`` or ``"fp8"``)."""
        return self.flops_fp8 if math_kind == "fp8" else self.flops_bf16


GPUS: dict[str, GpuSpec] = {
    # anchors.md: 4.24 TB/s copy, 805 TF bf16 GEMM, 1356 TF FP8 block GEMM (measured on the lent H200);
    # NVLink 4: 450 GB/s per direction x 0.77 (DeepEP's 153 of 200 GB/s on H800) ~ 345 GB/s;
    # one 400 Gb/s NIC per GPU, ~45 GB/s effective (DeepEP internode 43-58 GB/s).
    "h200": GpuSpec("H200", 4.24e12, 141e9, 805e12, 1356e12, 345e9, 45e9),
    # H800: same die as H100 (bf16 as measured on the H200's die), HBM3 3.35 TB/s spec, ~3.0 achieved
    # (FlashMLA 3000 GB/s); FP8 1550 TF (DeepGEMM); NVLink 153 GB/s (DeepEP intranode); IB ~45 GB/s.
    "h800": GpuSpec("H800", 3.0e12, 80e9, 805e12, 1550e12, 153e9, 45e9),
}


# ---- weight formats --------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightFormat:
    """Bytes per parameter of each weight class and the math the matmuls run in."""

    name: str
    linear: float  # FP8-able dense linears
    linear_bf16: float  # compressor / indexer / router projections (kept bf16)
    head: float  # output head
    expert: float  # routed experts
    dense_math: str  # "bf16" or "fp8"
    expert_math: str


FP8_BLOCK_SCALE = 4 / (128 * 128)  # one fp32 scale per 128x128 tile
FORMATS: dict[str, WeightFormat] = {
    # DeepInfer today with --keep-quantized off: everything dequantised to bf16
    "bf16": WeightFormat("bf16", 2.0, 2.0, 2.0, 2.0, "bf16", "bf16"),
    # DeepInfer --keep-quantized on: FP8 dense (W8A16), FP4 experts with fp32 scales per 32 (bf16 math)
    "fp8_fp4": WeightFormat("fp8_fp4", 1 + FP8_BLOCK_SCALE, 2.0, 2.0, 0.5 + 4 / 32, "bf16", "bf16"),
    # a production V4 engine: FP8 dense W8A8, MXFP4 experts (ue8m0 scale per 32), FP8 expert math
    "fp8_mxfp4": WeightFormat("fp8_mxfp4", 1 + FP8_BLOCK_SCALE, 2.0, 2.0, 0.5 + 1 / 32, "fp8", "fp8"),
}

KV_ENTRY_BYTES = {"bf16": 1024, "fp8": 584}  # V4 KV entry of 512 values (FlashMLA FP8 layout: 584 B)
INDEX_KEY_BYTES = {"bf16": 256, "fp8": 132}  # indexer key of 128 values (fp8 + one fp32 scale)


# ---- model shapes ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnLayer:
    """One attention layer: ``kind`` is ``sliding`` / ``csa`` / ``hca``."""

    kind: str
    window: int = 0
    ratio: int = 0
    topk: int = 0


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a model: parameter classes, MoE shape, attention layers."""

    name: str
    hidden: int
    vocab: int
    heads: int
    head_dim: int
    layers: tuple[AttnLayer, ...]
    moe_layers: int
    n_experts: int
    top_k: int
    expert_params: int  # one routed expert of one layer (gate + up + down)
    linear_params: int  # FP8-able dense linears (attention, shared experts, dense FFNs)
    linear_bf16_params: int  # compressor / indexer / router
    fp32_params: int  # norms, mHC, sinks, biases
    head_params: int  # output head
    hc_mult: int = 1  # residual streams (mHC)
    index_heads: int = 0
    index_dim: int = 0

    @property
    def total_params(self) -> int:
        """All parameters but the embedding (which is a lookup)."""
        experts = self.moe_layers * self.n_experts * self.expert_params
        return experts + self.linear_params + self.linear_bf16_params + self.fp32_params + self.head_params

    @property
    def active_params(self) -> int:
        """Matmul weights one token uses (dense linears, ``top_k`` experts per MoE layer, head)."""
        return (
            self.linear_params
            + self.linear_bf16_params
            + self.head_params
            + self.moe_layers * self.top_k * self.expert_params
        )


def v4_shape(cfg: DeepseekV4Config, name: str) -> ModelShape:
    """The cost-model shape of a DeepSeek-V4 config; parameter classes follow
    :func:`deepinfer_core.models.deepseek_v4.params.block_specs` (the test checks the totals)."""
    D, V, N = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    H, hd, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, ol = cfg.o_groups, cfg.o_lora_rank
    E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    ih, ihd = cfg.index_n_heads, cfg.index_head_dim
    hc = (2 + N) * N
    linear = bf16 = fp32 = 0
    layers: list[AttnLayer] = []
    for kind in cfg.layer_types:
        linear += ql * D + H * hd * ql + hd * D + G * ol * (H * hd // G) + D * G * ol  # q_a q_b kv o_a o_b
        fp32 += H + ql + hd  # sinks, q_a_norm, kv_norm
        if kind in (CSA, HCA):
            r = cfg.compress_rates[kind]
            coff = 2 if kind == CSA else 1
            bf16 += 2 * coff * hd * D
            fp32 += r * coff * hd + hd
            if kind == CSA:
                bf16 += 2 * 2 * ihd * D + ih * D
                fp32 += r * 2 * ihd + ihd
                linear += ih * ihd * ql
                layers.append(AttnLayer("csa", cfg.sliding_window, r, cfg.index_topk))
            else:
                layers.append(AttnLayer("hca", cfg.sliding_window, r))
        else:
            layers.append(AttnLayer("sliding", cfg.sliding_window))
        bf16 += E * D  # router
        fp32 += E  # e_score_correction_bias (hash layers hold tid2eid instead: subtracted below)
        linear += 3 * inter * D  # shared expert
        fp32 += 2 * D + 2 * (hc * N * D + hc + 3)  # two norms, attn_hc / ffn_hc
    hash_layers = sum(t == "hash_moe" for t in cfg.mlp_layer_types)
    fp32 -= hash_layers * E  # hash layers hold tid2eid instead of the bias
    fp32 += D + N * N * D + N + 1  # final norm, hc_head
    return ModelShape(
        name=name,
        hidden=D,
        vocab=V,
        heads=H,
        head_dim=hd,
        layers=tuple(layers),
        moe_layers=cfg.num_hidden_layers,
        n_experts=E,
        top_k=cfg.num_experts_per_tok,
        expert_params=3 * inter * D,
        linear_params=linear,
        linear_bf16_params=bf16,
        fp32_params=fp32,
        head_params=V * D,
        hc_mult=N,
        index_heads=ih,
        index_dim=ihd,
    )


def flash_config_dict(layers: int, experts: int) -> dict[str, Any]:
    """``config.json`` (HF names) of V4-Flash cut to ``layers`` layers and ``experts`` experts.

    ``layers=4, experts=64`` is the e2e benchmark model of ``gpu_e2e.py`` (``_gpu_model.flash_config``:
    ``[sliding, CSA, HCA, CSA]``).  The full model (43 layers, 256 experts) takes V4-Flash's
    ``compress_ratios`` as read from its checkpoint config: two sliding layers, then CSA / HCA
    alternating (21 CSA + 20 HCA); the HF default pattern (V4-Pro's: 2 HCA, then HCA/CSA) moves
    one CSA layer's cost by < 3 % of a step.
    """
    from _gpu_model import flash_config  # the e2e benchmark model's config

    cfg = flash_config(layers, experts)
    if layers >= 43:  # V4-Flash's own pattern: two sliding layers first
        cfg["layer_types"] = [SLIDING] * 2 + [CSA if i % 2 == 0 else HCA for i in range(layers - 2)]
    return cfg


def v4_flash() -> ModelShape:
    """DeepSeek-V4-Flash: 43 layers, 256 experts (284B total / 13B active)."""
    cfg = DeepseekV4Config.from_dict(flash_config_dict(43, 256), source="V4-Flash")
    return v4_shape(cfg, "V4-Flash (43 layers, 256 experts)")


def e2e_model() -> ModelShape:
    """The 4-layer, 64-expert e2e benchmark model of ``gpu_e2e.py`` (8.08B parameters)."""
    cfg = DeepseekV4Config.from_dict(flash_config_dict(4, 64), source="e2e model")
    return v4_shape(cfg, "e2e model (4 layers, 64 experts)")


# ---- attention ---------------------------------------------------------------------------------------
def attended(layer: AttnLayer, ctx: float) -> tuple[float, float]:
    """(KV entries one query at position ``ctx`` attends to, compressed entries its indexer scores)."""
    keys = min(ctx, layer.window)
    if layer.kind == "csa":
        n = ctx // layer.ratio
        return keys + min(layer.topk, n), n
    if layer.kind == "hca":
        return keys + ctx // layer.ratio, 0.0
    return keys, 0.0


def mean_attended(layer: AttnLayer, length: float) -> tuple[float, float]:
    """:func:`attended` averaged over the positions ``1..length`` of a prompt (closed forms)."""
    if length <= 0:
        return 0.0, 0.0
    w = layer.window
    win = (length + 1) / 2 if length <= w else (w * (w + 1) / 2 + (length - w) * w) / length
    if layer.kind == "sliding":
        return win, 0.0
    comp = max(0.0, (length + 1) / (2 * layer.ratio) - 0.5)  # mean of t // r
    if layer.kind == "hca":
        return win + comp, 0.0
    cap = layer.topk * layer.ratio  # positions beyond which top-k is full
    full = (cap * (layer.topk / 2) + (length - cap) * layer.topk) / length
    sel = comp if length <= cap else full
    return win + sel, comp


def attn_costs(
    m: ModelShape, ctx: float, kv_dtype: str, *, prefill_length: float | None = None
) -> dict[str, float]:
    """Per query token, summed over layers: attention FLOPs, indexer FLOPs and KV bytes read.

    Decode (``prefill_length`` None): the query sits at position ``ctx``.  Prefill: averaged over
    the positions of a ``prefill_length`` prompt; the cache is then read from on-chip tiles once per
    block of queries, so only the writes of the new entries count as HBM bytes.
    """
    flops = idx_flops = kv_bytes = kv_write = 0.0
    kv_b, idx_b = KV_ENTRY_BYTES[kv_dtype], INDEX_KEY_BYTES[kv_dtype]
    for layer in m.layers:
        keys, scored = (
            attended(layer, ctx) if prefill_length is None else mean_attended(layer, prefill_length)
        )
        flops += 4 * m.heads * m.head_dim * keys  # QK and PV, K = V (one shared head)
        idx_flops += (2 * m.index_dim + 1) * m.index_heads * scored
        kv_bytes += keys * kv_b + scored * idx_b
        kv_write += kv_b / (layer.ratio or 1) + (idx_b / layer.ratio if layer.kind == "csa" else 0.0)
        if layer.kind != "sliding":
            kv_write += kv_b  # the window entry of compressed layers
    return {"attn_flops": flops, "index_flops": idx_flops, "kv_read": kv_bytes, "kv_write": kv_write}


def kv_cache_bytes_per_seq(m: ModelShape, ctx: float, kv_dtype: str) -> float:
    """Cache bytes one sequence of ``ctx`` tokens holds (window + compressed entries + indexer keys)."""
    kv_b, idx_b = KV_ENTRY_BYTES[kv_dtype], INDEX_KEY_BYTES[kv_dtype]
    total = 0.0
    for la in m.layers:
        total += min(ctx, la.window) * kv_b
        if la.ratio:
            total += ctx / la.ratio * kv_b + (ctx / la.ratio * idx_b if la.kind == "csa" else 0.0)
    return total


# ---- routing -----------------------------------------------------------------------------------------
def expected_distinct(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts ``tokens`` tokens reach, each picking ``top_k`` of ``num_experts``
    uniformly: ``E (1 - (1 - k/E)^T)`` (same formula as ``_gpu_model.expected_distinct_experts``)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def prob_any(num_experts: int, top_k: int, held: int) -> float:
    """Probability that a token's ``top_k`` distinct experts include at least one of ``held``
    given experts: ``1 - C(E - m, k) / C(E, k)``."""
    if held >= num_experts:
        return 1.0
    return 1.0 - math.comb(num_experts - held, top_k) / math.comb(num_experts, top_k)


def popularity(num_experts: int, top_k: int, zipf: float) -> list[float]:
    """Per-expert probability that a token picks it (sums to ``top_k``): uniform for ``zipf=0``,
    else ``~ rank^-zipf`` over a fixed random permutation of the expert ids (seed 0)."""
    raw = [(i + 1) ** -zipf for i in range(num_experts)]
    random.Random(0).shuffle(raw)
    s = sum(raw)
    p = [top_k * r / s for r in raw]
    if max(p) > 1.0:
        raise ValueError(f"zipf={zipf} makes an expert more popular than once per token")
    return p


@dataclass
class Placement:
    """Physical experts of each GPU as ``(logical expert, share of its tokens)`` pairs."""

    gpus: list[list[tuple[int, float]]] = field(default_factory=list)


def place(p: list[float], world: int, redundant: int, eplb: bool) -> Placement:
    """Put ``len(p) + redundant`` physical experts on ``world`` GPUs, as many on each.

    Without EPLB: expert ids in order, ``E / world`` per GPU (replicas, if any, of the first ids).
    With EPLB (the global policy of deepseek-ai/EPLB): each replica goes to the logical expert of
    the highest load per replica, then physical experts, heaviest first, to the least loaded GPU
    with a free slot.  A token of an expert with ``r`` replicas goes to one of them (share ``1/r``).
    """
    E = len(p)
    if (E + redundant) % world:
        raise ValueError(f"{E} experts + {redundant} replicas do not divide over {world} GPUs")
    slots = (E + redundant) // world
    reps = [1] * E
    if eplb:
        for _ in range(redundant):
            e = max(range(E), key=lambda i: (p[i] / reps[i], -i))
            reps[e] += 1
    else:
        for i in range(redundant):
            reps[i % E] += 1
    phys = [(e, 1.0 / reps[e]) for e in range(E) for _ in range(reps[e])]
    gpus: list[list[tuple[int, float]]] = [[] for _ in range(world)]
    if eplb:
        load = [0.0] * world
        for e, share in sorted(phys, key=lambda x: (-p[x[0]] * x[1], x[0])):
            g = min((g for g in range(world) if len(gpus[g]) < slots), key=lambda g: (load[g], g))
            gpus[g].append((e, share))
            load[g] += p[e] * share
    else:
        for i, ph in enumerate(phys):
            gpus[i // slots].append(ph)
    return Placement(gpus)


@dataclass(frozen=True)
class Routing:
    """Routing scenario: ``zipf`` skew of expert popularity (0 = uniform) and EPLB on/off."""

    zipf: float = 0.0
    eplb: bool = False
    redundant: int | None = None  # replicas in all; None: one per GPU with EPLB under EP, else none

    @property
    def label(self) -> str:
        """Short name for tables."""
        if self.zipf == 0:
            return "uniform" + (" +EPLB" if self.eplb else "")
        return f"zipf {self.zipf:g}" + (" +EPLB" if self.eplb else " no EPLB")


def expert_load(m: ModelShape, routing: Routing, ep: int, global_tokens: float) -> dict[str, float]:
    """Per MoE layer on the busiest EP rank: routed rows it computes, distinct physical experts
    it reads, mean rows over ranks and the max/mean load ratio (routing skew + the statistical
    spread of a finite batch: ``lambda + sqrt(lambda * 2 ln ep)``)."""
    E, k = m.n_experts, m.top_k
    redundant = routing.redundant if routing.redundant is not None else (ep if routing.eplb else 0)
    if ep == 1:
        redundant = 0
    p = popularity(E, k, routing.zipf)
    pl = place(p, ep, redundant, routing.eplb)
    spread = math.sqrt(2 * math.log(ep)) if ep > 1 else 0.0
    rows = touched = 0.0
    for experts in pl.gpus:
        lam = global_tokens * sum(p[e] * s for e, s in experts)
        rows = max(rows, lam + spread * math.sqrt(lam))
        touched = max(touched, sum(1.0 - (1.0 - p[e] * s) ** global_tokens for e, s in experts))
    mean_rows = global_tokens * k / ep
    return {
        "rows": rows,
        "touched": touched,
        "held": len(pl.gpus[0]),
        "mean_rows": mean_rows,
        "imbalance": rows / mean_rows if mean_rows else 1.0,
        "redundant": redundant,
    }


# ---- the step ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Deployment:
    """How one step runs: ``world`` GPUs, attention DP over all of them, experts over ``ep`` of
    them (``ep`` = ``world`` with EP, 1 without), ``cp`` ranks sharing each prompt in prefill."""

    world: int
    ep: int
    cp: int = 1
    fmt: str = "fp8_mxfp4"
    kv_dtype: str = "fp8"
    dispatch: str = "ll"  # "ll": one row per (token, expert); "normal": one per GPU / node (DeepEP)
    dispatch_fp8: bool = True
    act_passes: int = 6  # reads + writes of the hc_mult residual streams per layer (bf16)
    kernels_per_layer: int = 20
    mtp_drafts: int = 0
    mtp_accept: float = 0.0


def a2a_bytes(
    m: ModelShape, dep: Deployment, gpu: GpuSpec, tokens: float, rows_in: float
) -> dict[str, float]:
    """Dispatch + combine bytes one GPU moves per MoE layer, split NVLink / InfiniBand.

    ``ll``: each (token, expert) pair is one row: ``tokens * k * (1 - 1/ep)`` rows leave the GPU
    (the busiest GPU receives ``rows_in * (1 - 1/ep)``), ``(g - 1) / ep`` of the pairs on NVLink and
    ``(ep - g) / ep`` over InfiniBand (``g`` GPUs per node).  ``normal``: one row per destination
    GPU in the node and one per destination node (forwarded there on NVLink).  Dispatch rows are
    FP8 + an fp32 scale per 128 (or bf16); combine rows bf16.
    """
    ep, k, D = dep.ep, m.top_k, m.hidden
    if ep <= 1:
        return {"nvlink": 0.0, "ib": 0.0, "dispatch_rows_out": 0.0}
    g = min(gpu.gpus_per_node, ep)
    nodes = ep / g
    row = D * (1 + 4 / 128) if dep.dispatch_fp8 else D * 2.0
    row_c = D * 2.0
    scale = max(1.0, rows_in / (tokens * k)) if tokens else 1.0  # the busiest GPU's receive side
    if dep.dispatch == "ll":
        pairs = tokens * k * scale
        nvl_rows, ib_rows = pairs * (g - 1) / ep, pairs * (ep - g) / ep
    else:
        m_gpu = m.n_experts // ep
        p_gpu = prob_any(m.n_experts, k, m_gpu)
        p_node = prob_any(m.n_experts, k, m_gpu * g)
        ib_rows = tokens * (nodes - 1) * p_node * scale
        nvl_rows = tokens * ((g - 1) * p_gpu + (nodes - 1) * (g - 1) * p_gpu) * scale
    return {
        "nvlink": nvl_rows * (row + row_c),
        "ib": ib_rows * (row + row_c),
        "nvlink_dispatch": nvl_rows * row,
        "ib_dispatch": ib_rows * row,
        "dispatch_rows_out": nvl_rows + ib_rows,
    }


def step(
    m: ModelShape,
    gpu: GpuSpec,
    dep: Deployment,
    *,
    tokens: float,
    ctx: float,
    phase: str = "decode",
    routing: Routing = Routing(),
    prompt: float | None = None,
) -> dict[str, Any]:
    """Cost of one step on one GPU of ``dep``.

    Decode: ``tokens`` sequences per GPU, each at context ``ctx``, one new token each (``1 +
    mtp_drafts`` processed with MTP).  Prefill: ``tokens`` prompt tokens per GPU of prompts of
    ``prompt`` tokens (default ``ctx``); with ``dep.cp = C`` each prompt is split over C GPUs (its
    attention work and cache exchange shared zig-zag), so a GPU holds ``tokens`` of it.
    Returns bytes, FLOPs, network bytes, the component times and both totals (``t_sum``,
    ``t_max``), tokens/s per GPU for each and the HBM footprint.
    """
    fmt = FORMATS[dep.fmt]
    D = m.hidden
    per_seq = 1 + dep.mtp_drafts if phase == "decode" else 1
    rows = tokens * per_seq  # tokens through the layers on this GPU
    out_tokens = tokens * (1 + dep.mtp_drafts * dep.mtp_accept) if phase == "decode" else tokens
    head_rows = rows if phase == "decode" else tokens / (prompt or ctx) * dep.cp  # one logit row per prompt
    # weights
    dense_bytes = (
        m.linear_params * fmt.linear
        + m.linear_bf16_params * fmt.linear_bf16
        + m.fp32_params * 4
        + m.head_params * fmt.head
        + rows * D * 2  # embedding rows
    )
    # with EP the experts of this GPU see every rank's rows; without, only its own
    load = expert_load(m, routing, dep.ep, rows * dep.world if dep.ep > 1 else rows)
    expert_bytes = load["touched"] * m.moe_layers * m.expert_params * fmt.expert
    # attention and cache
    if phase == "decode":
        a = attn_costs(m, ctx, dep.kv_dtype)
        kv_bytes = rows * (a["kv_read"] + a["kv_write"])
        attn_flops = rows * (a["attn_flops"] + a["index_flops"])
    else:
        L = prompt or ctx
        a = attn_costs(m, L, dep.kv_dtype, prefill_length=L)
        kv_bytes = rows * a["kv_write"]
        attn_flops = rows * (a["attn_flops"] + a["index_flops"])
    act_bytes = rows * len(m.layers) * dep.act_passes * m.hc_mult * D * 2
    hbm = dense_bytes + expert_bytes + kv_bytes + act_bytes
    # FLOPs
    dense_flops = 2 * rows * (m.linear_params + m.linear_bf16_params) + 2 * head_rows * m.head_params
    expert_flops = 2 * m.expert_params * load["rows"] * m.moe_layers
    t_flop = (
        dense_flops / gpu.peak(fmt.dense_math)
        + expert_flops / gpu.peak(fmt.expert_math)
        + attn_flops / gpu.flops_bf16
    )
    t_hbm = hbm / gpu.hbm_bw
    # network
    net = a2a_bytes(m, dep, gpu, rows, load["rows"])
    calls = 2 * m.moe_layers if dep.ep > 1 else 0
    t_a2a = (
        m.moe_layers * max(net["nvlink"] / gpu.nvlink_bw, net["ib"] / gpu.ib_bw) + calls * gpu.a2a_latency_s
    )
    cp_bytes = 0.0
    if phase == "prefill" and dep.cp > 1:
        L = prompt or ctx
        kv_b, idx_b = KV_ENTRY_BYTES[dep.kv_dtype], INDEX_KEY_BYTES[dep.kv_dtype]
        for la in m.layers:  # all-gather of the other ranks' compressed entries + two window halos
            comp = (L / la.ratio) * (kv_b + (idx_b if la.kind == "csa" else 0)) if la.ratio else 0.0
            cp_bytes += comp * (dep.cp - 1) / dep.cp + 2 * la.window * kv_b
    cp_bw = gpu.nvlink_bw if dep.cp <= gpu.gpus_per_node else gpu.ib_bw
    t_cp = cp_bytes / cp_bw + (len(m.layers) * gpu.a2a_latency_s if dep.cp > 1 else 0.0)
    t_net = t_a2a + t_cp
    t_over = gpu.step_overhead_s + len(m.layers) * dep.kernels_per_layer * gpu.kernel_overhead_s
    t_sum = t_hbm + t_flop + t_net + t_over
    t_max = max(t_hbm, t_flop, t_net) + t_over
    limiter = max((("HBM", t_hbm), ("compute", t_flop), ("network", t_net)), key=lambda x: x[1])[0]
    weights_resident = (
        dense_bytes
        - rows * D * 2
        + (m.n_experts + load["redundant"]) / dep.ep * m.moe_layers * m.expert_params * fmt.expert
    )
    seqs = tokens if phase == "decode" else 0
    kv_resident = seqs * kv_cache_bytes_per_seq(m, ctx, dep.kv_dtype)
    return {
        "tokens_per_gpu": tokens,
        "rows_per_gpu": rows,
        "bytes": {
            "dense_weights": dense_bytes,
            "expert_weights": expert_bytes,
            "kv": kv_bytes,
            "activations": act_bytes,
            "hbm_total": hbm,
        },
        "flops": {"dense": dense_flops, "experts": expert_flops, "attention": attn_flops},
        "experts": {
            "touched_busiest": load["touched"],
            "held": load["held"],
            "rows_busiest": load["rows"],
            "rows_mean": load["mean_rows"],
            "imbalance": load["imbalance"],
            "redundant": load["redundant"],
        },
        "network": {
            "nvlink_bytes": net["nvlink"] * m.moe_layers,
            "ib_bytes": net["ib"] * m.moe_layers,
            "dispatch_rows_out_per_layer": net["dispatch_rows_out"],
            "cp_bytes": cp_bytes,
        },
        "time": {
            "hbm": t_hbm,
            "compute": t_flop,
            "network": t_net,
            "overhead": t_over,
            "sum": t_sum,
            "max": t_max,
        },
        "limiter": limiter,
        "tok_s_per_gpu_sum": out_tokens / t_sum,
        "tok_s_per_gpu_max": out_tokens / t_max,
        "memory_gb": {"weights": weights_resident / 1e9, "kv": kv_resident / 1e9},
        "fits": weights_resident + kv_resident <= gpu.hbm_bytes,
    }


def deployment(world: int, ep: bool = True, **kw: Any) -> Deployment:
    """A DP(+EP) deployment of ``world`` GPUs (experts over all of them when ``ep``)."""
    return Deployment(world=world, ep=world if ep else 1, **kw)


# ---- tables ------------------------------------------------------------------------------------------
WORLDS = (1, 2, 8, 16, 32, 64)
BATCHES = (64, 256, 1024)
CONTEXTS = (4096, 32768)


def scaling_table(gpu: GpuSpec, routing: Routing, fmt: str = "fp8_mxfp4") -> list[dict[str, Any]]:
    """V4-Flash decode per GPU for each world size, batch per GPU and context."""
    m = v4_flash()
    rows = []
    for ctx in CONTEXTS:
        for world in WORLDS:
            for b in BATCHES:
                r = step(m, gpu, deployment(world, fmt=fmt), tokens=b, ctx=ctx, routing=routing)
                rows.append(_row("decode", world, b, ctx, r, routing))
    return rows


def prefill_table(gpu: GpuSpec, routing: Routing, fmt: str = "fp8_mxfp4") -> list[dict[str, Any]]:
    """V4-Flash prefill per GPU: 8k tokens per GPU of 32k / 128k prompts without CP, and each
    prompt split over C = min(8, world) ranks (CP) — throughput and the prompt's TTFT."""
    m = v4_flash()
    rows = []
    for L in (32768, 131072):
        for world in WORLDS:
            for cp in sorted({1, min(8, world)}):
                tokens = L / cp if cp > 1 else 8192
                dep = deployment(world, fmt=fmt, cp=cp, dispatch="normal")
                r = step(m, gpu, dep, tokens=tokens, ctx=L, phase="prefill", routing=routing, prompt=L)
                row = _row("prefill", world, tokens, L, r, routing)
                row["cp"] = cp
                steps = L / tokens if cp == 1 else 1  # a prompt without CP takes L / 8192 steps on one GPU
                row["ttft_s_max"] = steps * r["time"]["max"]
                row["ttft_s_sum"] = steps * r["time"]["sum"]
                rows.append(row)
    return rows


def _row(phase: str, world: int, b: float, ctx: float, r: dict[str, Any], routing: Routing) -> dict[str, Any]:
    t = r["time"]
    return {
        "phase": phase,
        "world": world,
        "tokens_per_gpu": b,
        "ctx": ctx,
        "routing": routing.label,
        "tok_s_max": r["tok_s_per_gpu_max"],
        "tok_s_sum": r["tok_s_per_gpu_sum"],
        "t_hbm_ms": t["hbm"] * 1e3,
        "t_compute_ms": t["compute"] * 1e3,
        "t_network_ms": t["network"] * 1e3,
        "t_overhead_ms": t["overhead"] * 1e3,
        "limiter": r["limiter"],
        "expert_gb": r["bytes"]["expert_weights"] / 1e9,
        "dense_gb": r["bytes"]["dense_weights"] / 1e9,
        "kv_gb": r["bytes"]["kv"] / 1e9,
        "nvlink_mb": r["network"]["nvlink_bytes"] / 1e6,
        "ib_mb": r["network"]["ib_bytes"] / 1e6,
        "imbalance": r["experts"]["imbalance"],
        "weights_gb_resident": r["memory_gb"]["weights"],
        "kv_gb_resident": r["memory_gb"]["kv"],
        "fits": r["fits"],
    }


TABLE_COLUMNS = [
    ("GPUs", "world", "d"), ("tok/GPU", "tokens_per_gpu", ".0f"), ("ctx", "ctx", ".0f"),
    ("tok/s max", "tok_s_max", ",.0f"), ("tok/s sum", "tok_s_sum", ",.0f"), ("HBM ms", "t_hbm_ms", ".2f"),
    ("FLOP ms", "t_compute_ms", ".2f"), ("net ms", "t_network_ms", ".2f"), ("ovh ms", "t_overhead_ms", ".2f"),
    ("exp GB", "expert_gb", ".2f"), ("imb", "imbalance", ".2f"), ("mem GB", "mem_gb", ".0f"),
    ("fits", "fits", ""), ("limit", "limiter", ""),
]  # fmt: skip


def print_rows(title: str, rows: list[dict[str, Any]], extra: tuple[tuple[str, str, str], ...] = ()) -> None:
    """Print ``rows`` of :func:`scaling_table` / :func:`prefill_table` as a table."""
    print(f"\n{title}")
    shown = [{**r, "mem_gb": r["weights_gb_resident"] + r["kv_gb_resident"]} for r in rows]
    print_table(shown, [*TABLE_COLUMNS, *extra])


def main(argv: list[str] | None = None) -> int:
    """Print the V4-Flash scaling tables; write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    ap.add_argument("--fmt", choices=sorted(FORMATS), default="fp8_mxfp4", help="weight format of V4-Flash")
    ap.add_argument("--zipf", type=float, default=0.3, help="skew of the skewed routing scenarios")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    gpu = GPUS[args.gpu]
    m = v4_flash()
    print(
        f"{m.name}: {m.total_params / 1e9:.1f}B parameters + embedding, {m.active_params / 1e9:.2f}B active "
        f"per token; GPU {gpu.name}; weights {args.fmt}; KV fp8 (584 B / entry)"
    )
    uniform, skew_eplb, skew = Routing(), Routing(args.zipf, True), Routing(args.zipf, False)
    data: dict[str, Any] = {
        "model": {"name": m.name, "params": m.total_params, "active": m.active_params},
        "gpu": asdict(gpu),
        "fmt": asdict(FORMATS[args.fmt]),
        "decode": {},
        "prefill": {},
    }
    for routing in (uniform, skew_eplb, skew):
        rows = scaling_table(gpu, routing, args.fmt)
        data["decode"][routing.label] = rows
        if routing is uniform:
            print_rows(f"decode, V4-Flash, DP = EP = GPUs, routing {routing.label}", rows)
        else:
            sel = [r for r in rows if r["ctx"] == 4096]
            print_rows(f"decode ctx 4096, routing {routing.label}", sel)
    pre = prefill_table(gpu, uniform, args.fmt)
    data["prefill"][uniform.label] = pre
    print_rows(
        "prefill, V4-Flash, 8192 tokens per GPU (cp 1) or prompt / C (cp C)",
        pre,
        (("cp", "cp", "d"), ("TTFT s", "ttft_s_max", ".3g")),
    )
    write_json(args.out, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
