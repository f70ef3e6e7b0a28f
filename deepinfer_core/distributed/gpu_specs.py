"""Per-GPU ceilings of the cost model (:mod:`deepinfer_core.distributed.cost_model`) and the
benchmarks' rooflines: the presets of the GPUs measured here, and a CUDA device name's preset."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    """Per-GPU ceilings (achievable figures where measured): HBM bytes/s and capacity, FLOP/s,
    bytes/s one GPU sends on NVLink inside its node / on its NIC to other nodes, the fixed cost
    of one dispatch or combine call, of one kernel inside a CUDA graph and of one step."""

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


GPUS: dict[str, GpuSpec] = {  # sources: docs/distributed_cost_model.md
    "h200": GpuSpec("H200", 4.24e12, 141e9, 805e12, 1356e12, 345e9, 45e9),
    "h800": GpuSpec("H800", 3.0e12, 80e9, 805e12, 1550e12, 153e9, 45e9),
}

DEVICE_PRESETS = {"H200": "h200", "H100": "h800", "H800": "h800"}
"""The :data:`GPUS` preset of each GPU kind, by a word of the name CUDA reports (the H100 and the
H800 share the H800's HBM3 figures)."""


def device_hbm_bandwidth(name: str) -> tuple[float, str, bool]:
    """HBM bytes/s of the preset for a CUDA device name (``"NVIDIA H100 80GB HBM3"``: the H800's
    3.0e12), the GPU kind it is for, and whether a preset matched (if not, the H200's stands in
    and the kind says so)."""
    kind = next((k for k in DEVICE_PRESETS if k in name.upper()), None)
    if kind is None:
        return GPUS["h200"].hbm_bw, f"H200 (for {name})", False
    return GPUS[DEVICE_PRESETS[kind]].hbm_bw, kind, True
