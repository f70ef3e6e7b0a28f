"""The DP/EP/CP cost model's V4-Flash tables: decode per GPU on 1-64 GPUs, prefill with and without CP.

The model: :mod:`deepinfer_core.distributed.cost_model` (decode by routing scenario); equations
and the reading of the tables: docs/distributed_cost_model.md."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

from deepinfer_core.benchmarking.harness import parser, print_table, run_main, write_json  # noqa: E402
from deepinfer_core.distributed import cost_model as cm  # noqa: E402
from deepinfer_core.distributed.gpu_specs import GPUS, GpuSpec  # noqa: E402
from deepinfer_core.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config  # noqa: E402

WORLDS, BATCHES, CONTEXTS = (1, 2, 8, 16, 32, 64), (64, 256, 1024), (4096, 32768)


def flash_config_dict(layers: int, experts: int) -> dict[str, Any]:
    """``config.json`` of V4-Flash cut to ``layers`` layers and ``experts`` experts: the e2e
    benchmark model (``_gpu_model.flash_config``) below 43 layers, V4-Flash's own layer pattern
    (two sliding layers, then CSA / HCA alternating) from 43 on."""
    from _gpu_model import flash_config

    cfg = flash_config(layers, experts)
    if layers >= 43:
        cfg["layer_types"] = [SLIDING] * 2 + [CSA if i % 2 == 0 else HCA for i in range(layers - 2)]
    return cfg


def v4_flash(layers: int = 43, experts: int = 256) -> cm.ModelShape:
    """DeepSeek-V4-Flash (284B total / 13B active), or cut to ``layers`` and ``experts`` (4 and
    64: the e2e benchmark model of ``gpu_e2e.py``, 8.08B parameters)."""
    cfg = DeepseekV4Config.from_dict(flash_config_dict(layers, experts), source="V4-Flash")
    return cm.v4_shape(cfg, f"V4-Flash ({layers} layers, {experts} experts)")


def _row(phase: str, world: int, b: float, ctx: float, r: dict, routing: cm.Routing) -> dict[str, Any]:
    t, by, mem = r["time"], r["bytes"], r["memory_gb"]
    return {
        "phase": phase, "world": world, "tokens_per_gpu": b, "ctx": ctx, "routing": routing.label,
        "tok_s_max": r["tok_s_per_gpu_max"], "tok_s_sum": r["tok_s_per_gpu_sum"],
        **{f"t_{k}_ms": t[k] * 1e3 for k in ("hbm", "compute", "network", "overhead")},
        "limiter": r["limiter"], "expert_gb": by["expert_weights"] / 1e9,
        "dense_gb": by["dense_weights"] / 1e9, "kv_gb": by["kv"] / 1e9,
        "nvlink_mb": r["network"]["nvlink_bytes"] / 1e6, "ib_mb": r["network"]["ib_bytes"] / 1e6,
        "imbalance": r["experts"]["imbalance"], "weights_gb_resident": mem["weights"],
        "kv_gb_resident": mem["kv"], "fits": r["fits"],
    }  # fmt: skip


def scaling_table(gpu: GpuSpec, routing: cm.Routing, fmt: str = "fp8_mxfp4") -> list[dict[str, Any]]:
    """V4-Flash decode per GPU for each context, world size and batch per GPU."""
    m, rows = v4_flash(), []
    for ctx in CONTEXTS:
        for w in WORLDS:
            for b in BATCHES:
                r = cm.step(m, gpu, cm.deployment(w, fmt=fmt), tokens=b, ctx=ctx, routing=routing)
                rows.append(_row("decode", w, b, ctx, r, routing))
    return rows


def prefill_table(gpu: GpuSpec, routing: cm.Routing, fmt: str = "fp8_mxfp4") -> list[dict[str, Any]]:
    """V4-Flash prefill per GPU: 8k tokens per GPU of 32k / 128k prompts without CP, and each
    prompt split over C = min(8, world) ranks (CP); throughput and the prompt's TTFT."""
    m, rows = v4_flash(), []
    for L in (32768, 131072):
        for world in WORLDS:
            for cp in sorted({1, min(8, world)}):
                tokens = L / cp if cp > 1 else 8192
                dep = cm.deployment(world, fmt=fmt, cp=cp, dispatch="normal")
                r = cm.step(m, gpu, dep, tokens=tokens, ctx=L, phase="prefill", routing=routing, prompt=L)
                steps = L / tokens if cp == 1 else 1  # without CP a prompt takes L / 8192 steps
                row = _row("prefill", world, tokens, L, r, routing)
                rows.append({**row, "cp": cp, "ttft_s_max": steps * r["time"]["max"],
                             "ttft_s_sum": steps * r["time"]["sum"]})  # fmt: skip
    return rows


COLUMNS = "world:d tokens_per_gpu:.0f ctx:.0f tok_s_max:,.0f tok_s_sum:,.0f t_hbm_ms:.2f t_compute_ms:.2f"
COLUMNS += " t_network_ms:.2f t_overhead_ms:.2f expert_gb:.2f imbalance:.2f mem_gb:.0f fits limiter"


def print_rows(title: str, rows: list[dict[str, Any]], extra: str = "") -> None:
    print(f"\n{title}")
    print_table(
        [{**r, "mem_gb": r["weights_gb_resident"] + r["kv_gb_resident"]} for r in rows], COLUMNS + extra
    )


def main(argv: list[str] | None = None) -> None:
    """Print the V4-Flash scaling tables; write the JSON."""
    ap = parser(__doc__, "distributed_cost_model", threads=None)  # --output (--out, --json)
    ap.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    ap.add_argument("--fmt", choices=sorted(cm.FORMATS), default="fp8_mxfp4", help="V4-Flash's weights")
    ap.add_argument("--zipf", type=float, default=0.3, help="skew of the skewed routing scenarios")
    args = ap.parse_args(argv)
    gpu, m = GPUS[args.gpu], v4_flash()
    print(
        f"{m.name}: {m.total_params / 1e9:.1f}B parameters + embedding, {m.active_params / 1e9:.2f}B active "
        f"per token; GPU {gpu.name}; weights {args.fmt}; KV fp8 (592 B / entry)"
    )
    model = {"name": m.name, "params": m.total_params, "active": m.active_params}
    data = {"model": model, "gpu": asdict(gpu), "fmt": asdict(cm.FORMATS[args.fmt]), "decode": {}}
    uniform = cm.Routing()
    for routing in (uniform, cm.Routing(args.zipf, True), cm.Routing(args.zipf, False)):
        rows = data["decode"][routing.label] = scaling_table(gpu, routing, args.fmt)
        if routing is uniform:
            print_rows(f"decode, V4-Flash, DP = EP = GPUs, routing {routing.label}", rows)
        else:
            print_rows(f"decode ctx 4096, routing {routing.label}", [r for r in rows if r["ctx"] == 4096])
    pre = prefill_table(gpu, uniform, args.fmt)
    data["prefill"] = {uniform.label: pre}
    title = "prefill, V4-Flash, 8192 tokens per GPU (cp 1) or prompt / C (cp C)"
    print_rows(title, pre, " cp:d ttft_s_max:.3g")
    write_json(args.output, data)


if __name__ == "__main__":
    run_main(main)
