"""A per-step cost model of DeepSeek-V4 under attention DP + MoE EP (+ EPLB replicas) and context
parallelism: for one GPU of a ``world``-GPU deployment, the HBM bytes, FLOPs and NVLink /
InfiniBand bytes of one step, turned into a time (``sum``: no overlap; ``max``: perfect overlap)
and tokens/s per GPU.

Pure Python (shapes from :class:`~deepinfer_core.models.deepseek_v4.config.DeepseekV4Config`).
The equations, the presets' sources, the assumptions and the comparisons with measured figures:
``docs/distributed_cost_model.md``; ``benchmarks/distributed_cost_model.py`` prints its tables.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from deepinfer_core.distributed.gpu_specs import GpuSpec
from deepinfer_core.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config


@dataclass(frozen=True)
class WeightFormat:
    """Bytes per parameter of each weight class and the math the matmuls run in: FP8-able dense
    linears, bf16-kept projections (compressor / indexer / router), output head, routed experts."""

    name: str
    linear: float
    linear_bf16: float
    head: float
    expert: float
    dense_math: str  # "bf16" or "fp8"
    expert_math: str


FP8_BLOCK_SCALE = 4 / (128 * 128)  # one fp32 scale per 128x128 tile
FORMATS: dict[str, WeightFormat] = {
    "bf16": WeightFormat("bf16", 2.0, 2.0, 2.0, 2.0, "bf16", "bf16"),  # --keep-quantized off
    # --keep-quantized on: FP8 dense (W8A16), FP4 experts with fp32 scales per 32, bf16 math
    "fp8_fp4": WeightFormat("fp8_fp4", 1 + FP8_BLOCK_SCALE, 2.0, 2.0, 0.5 + 4 / 32, "bf16", "bf16"),
    # a production V4 engine: FP8 dense W8A8, MXFP4 experts (ue8m0 scale per 32), FP8 math
    "fp8_mxfp4": WeightFormat("fp8_mxfp4", 1 + FP8_BLOCK_SCALE, 2.0, 2.0, 0.5 + 1 / 32, "fp8", "fp8"),
}
KV_ENTRY_BYTES = {"bf16": 1024, "fp8": 592}  # a KV entry of 512 values (FlashMLA FP8 layout)
INDEX_KEY_BYTES = {"bf16": 256, "fp8": 132}  # an indexer key of 128 values (fp8 + fp32 scale)


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
    head_params: int
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
        dense = self.linear_params + self.linear_bf16_params + self.head_params
        return dense + self.moe_layers * self.top_k * self.expert_params


def v4_shape(cfg: DeepseekV4Config, name: str) -> ModelShape:
    """The cost-model shape of a DeepSeek-V4 config; parameter classes follow
    :func:`deepinfer_core.models.deepseek_v4.params.block_specs`."""
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
        fp32 += E  # e_score_correction_bias
        linear += 3 * inter * D  # shared expert
        fp32 += 2 * D + 2 * (hc * N * D + hc + 3)  # two norms, attn_hc / ffn_hc
    fp32 -= sum(t == "hash_moe" for t in cfg.mlp_layer_types) * E  # hash layers: tid2eid, no bias
    fp32 += D + N * N * D + N + 1  # final norm, hc_head
    return ModelShape(
        name, D, V, H, hd, tuple(layers), cfg.num_hidden_layers, E, cfg.num_experts_per_tok,
        expert_params=3 * inter * D, linear_params=linear, linear_bf16_params=bf16, fp32_params=fp32,
        head_params=V * D, hc_mult=N, index_heads=ih, index_dim=ihd,
    )  # fmt: skip


# ---- attention ----------------------------------------------------------------------------------
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
    return win + (comp if length <= cap else full), comp


def attn_costs(m: ModelShape, ctx: float, kv_dtype: str, *, prefill_length: float | None = None) -> dict:
    """Per query token, summed over layers: attention FLOPs, indexer FLOPs, KV bytes read and
    written; at position ``ctx`` (decode) or averaged over a ``prefill_length`` prompt."""
    flops = idx_flops = kv_bytes = kv_write = 0.0
    kv_b, idx_b = KV_ENTRY_BYTES[kv_dtype], INDEX_KEY_BYTES[kv_dtype]
    for layer in m.layers:
        if prefill_length is None:
            keys, scored = attended(layer, ctx)
        else:
            keys, scored = mean_attended(layer, prefill_length)
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


# ---- routing ------------------------------------------------------------------------------------
def expected_distinct(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts ``tokens`` uniformly routed tokens reach: ``E (1 - (1 - k/E)^T)``."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def prob_any(num_experts: int, top_k: int, held: int) -> float:
    """Probability that a token's ``top_k`` experts include one of ``held`` given ones:
    ``1 - C(E - m, k) / C(E, k)``."""
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


def place(p: list[float], world: int, redundant: int, eplb: bool) -> list[list[tuple[int, float]]]:
    """Put ``len(p) + redundant`` physical experts on ``world`` GPUs, as many on each (per GPU
    ``(logical expert, share of its tokens)`` pairs): expert ids
    in order (replicas of the first ids) without EPLB; with EPLB the global policy of
    deepseek-ai/EPLB (replicas to the highest load per replica, heaviest first to the least
    loaded GPU).  A token of an expert with ``r`` replicas goes to one of them (share ``1/r``)."""
    E = len(p)
    if (E + redundant) % world:
        raise ValueError(f"{E} experts + {redundant} replicas do not divide over {world} GPUs")
    slots = (E + redundant) // world
    reps = [1] * E
    for i in range(redundant):
        reps[max(range(E), key=lambda e: (p[e] / reps[e], -e)) if eplb else i % E] += 1
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
    return gpus


@dataclass(frozen=True)
class Routing:
    """Routing scenario: ``zipf`` skew of expert popularity (0 = uniform), EPLB on/off and the
    replicas in all (``None``: one per GPU with EPLB under EP, else none)."""

    zipf: float = 0.0
    eplb: bool = False
    redundant: int | None = None

    @property
    def label(self) -> str:
        """Short name for tables."""
        if self.zipf == 0:
            return "uniform" + (" +EPLB" if self.eplb else "")
        return f"zipf {self.zipf:g}" + (" +EPLB" if self.eplb else " no EPLB")


def expert_load(m: ModelShape, routing: Routing, ep: int, global_tokens: float) -> dict[str, float]:
    """Per MoE layer on the busiest EP rank: routed rows it computes (``lambda + sqrt(lambda *
    2 ln ep)``), distinct physical experts it reads, mean rows and the max/mean load ratio."""
    E, k = m.n_experts, m.top_k
    redundant = routing.redundant if routing.redundant is not None else (ep if routing.eplb else 0)
    if ep == 1:
        redundant = 0
    p = popularity(E, k, routing.zipf)
    gpus = place(p, ep, redundant, routing.eplb)
    spread = math.sqrt(2 * math.log(ep)) if ep > 1 else 0.0
    rows = touched = 0.0
    for experts in gpus:
        lam = global_tokens * sum(p[e] * s for e, s in experts)
        rows = max(rows, lam + spread * math.sqrt(lam))
        touched = max(touched, sum(1.0 - (1.0 - p[e] * s) ** global_tokens for e, s in experts))
    mean_rows = global_tokens * k / ep
    imbalance = rows / mean_rows if mean_rows else 1.0
    held = len(gpus[0])
    return {"rows": rows, "touched": touched, "held": held, "mean_rows": mean_rows,
            "imbalance": imbalance, "redundant": redundant}  # fmt: skip


# ---- the step -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Deployment:
    """How one step runs: attention DP over ``world`` GPUs, experts over ``ep`` of them, ``cp``
    ranks sharing each prompt in prefill; dispatch ``ll`` (one row per (token, expert)) or
    ``normal`` (one per destination GPU / node, DeepEP); MTP drafts and their acceptance."""

    world: int
    ep: int
    cp: int = 1
    fmt: str = "fp8_mxfp4"
    kv_dtype: str = "fp8"
    dispatch: str = "ll"
    dispatch_fp8: bool = True
    act_passes: int = 6  # reads + writes of the hc_mult residual streams per layer (bf16)
    kernels_per_layer: int = 20
    mtp_drafts: int = 0
    mtp_accept: float = 0.0


def a2a_bytes(m: ModelShape, dep: Deployment, gpu: GpuSpec, tokens: float, rows_in: float) -> dict:
    """Dispatch + combine bytes one GPU moves per MoE layer, split NVLink / InfiniBand (the
    busiest GPU receives ``rows_in``); FP8 dispatch rows with an fp32 scale per 128, bf16 combine."""
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
    return {"nvlink": nvl_rows * (row + row_c), "ib": ib_rows * (row + row_c),
            "nvlink_dispatch": nvl_rows * row, "ib_dispatch": ib_rows * row,
            "dispatch_rows_out": nvl_rows + ib_rows}  # fmt: skip


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
    """Cost of one step on one GPU of ``dep``: decode of ``tokens`` sequences per GPU at context
    ``ctx``, or prefill of ``tokens`` prompt tokens per GPU of prompts of ``prompt`` tokens
    (default ``ctx``; with ``dep.cp = C`` a prompt is split over C GPUs).  Bytes, FLOPs, network
    bytes, component times, both totals, tokens/s per GPU and the HBM footprint."""
    fmt = FORMATS[dep.fmt]
    D = m.hidden
    per_seq = 1 + dep.mtp_drafts if phase == "decode" else 1
    rows = tokens * per_seq  # tokens through the layers on this GPU
    out_tokens = tokens * (1 + dep.mtp_drafts * dep.mtp_accept) if phase == "decode" else tokens
    head_rows = rows if phase == "decode" else tokens / (prompt or ctx) * dep.cp  # a logit row per prompt
    dense_bytes = m.linear_params * fmt.linear + m.linear_bf16_params * fmt.linear_bf16 + m.fp32_params * 4
    dense_bytes += m.head_params * fmt.head
    dense_bytes += rows * D * 2  # embedding rows
    # with EP the experts of this GPU see every rank's rows; without, only its own
    load = expert_load(m, routing, dep.ep, rows * dep.world if dep.ep > 1 else rows)
    expert_bytes = load["touched"] * m.moe_layers * m.expert_params * fmt.expert
    if phase == "decode":
        a = attn_costs(m, ctx, dep.kv_dtype)
        kv_bytes = rows * (a["kv_read"] + a["kv_write"])
    else:  # the cache is read from on-chip tiles: only the new entries' writes count
        L = prompt or ctx
        a = attn_costs(m, L, dep.kv_dtype, prefill_length=L)
        kv_bytes = rows * a["kv_write"]
    attn_flops = rows * (a["attn_flops"] + a["index_flops"])
    act_bytes = rows * len(m.layers) * dep.act_passes * m.hc_mult * D * 2
    hbm = dense_bytes + expert_bytes + kv_bytes + act_bytes
    dense_flops = 2 * rows * (m.linear_params + m.linear_bf16_params) + 2 * head_rows * m.head_params
    expert_flops = 2 * m.expert_params * load["rows"] * m.moe_layers
    t_flop = dense_flops / gpu.peak(fmt.dense_math) + expert_flops / gpu.peak(fmt.expert_math)
    t_flop += attn_flops / gpu.flops_bf16
    t_hbm = hbm / gpu.hbm_bw
    net = a2a_bytes(m, dep, gpu, rows, load["rows"])
    calls = 2 * m.moe_layers if dep.ep > 1 else 0
    t_a2a = m.moe_layers * max(net["nvlink"] / gpu.nvlink_bw, net["ib"] / gpu.ib_bw)
    t_a2a += calls * gpu.a2a_latency_s
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
    experts_held = (m.n_experts + load["redundant"]) / dep.ep
    weights_resident = dense_bytes - rows * D * 2 + experts_held * m.moe_layers * m.expert_params * fmt.expert
    kv_resident = (tokens if phase == "decode" else 0) * kv_cache_bytes_per_seq(m, ctx, dep.kv_dtype)
    return {
        "tokens_per_gpu": tokens,
        "rows_per_gpu": rows,
        "bytes": {"dense_weights": dense_bytes, "expert_weights": expert_bytes, "kv": kv_bytes,
                  "activations": act_bytes, "hbm_total": hbm},
        "flops": {"dense": dense_flops, "experts": expert_flops, "attention": attn_flops},
        "experts": {"touched_busiest": load["touched"], "held": load["held"], "rows_busiest": load["rows"],
                    "rows_mean": load["mean_rows"], "imbalance": load["imbalance"],
                    "redundant": load["redundant"]},
        "network": {"nvlink_bytes": net["nvlink"] * m.moe_layers, "ib_bytes": net["ib"] * m.moe_layers,
                    "dispatch_rows_out_per_layer": net["dispatch_rows_out"], "cp_bytes": cp_bytes},
        "time": {"hbm": t_hbm, "compute": t_flop, "network": t_net, "overhead": t_over,
                 "sum": t_sum, "max": t_max},
        "limiter": limiter,
        "tok_s_per_gpu_sum": out_tokens / t_sum,
        "tok_s_per_gpu_max": out_tokens / t_max,
        "memory_gb": {"weights": weights_resident / 1e9, "kv": kv_resident / 1e9},
        "fits": weights_resident + kv_resident <= gpu.hbm_bytes,
    }  # fmt: skip


def deployment(world: int, ep: bool = True, **kw: Any) -> Deployment:
    """A DP(+EP) deployment of ``world`` GPUs (experts over all of them when ``ep``)."""
    return Deployment(world=world, ep=world if ep else 1, **kw)
