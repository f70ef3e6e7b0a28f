"""The reference backend on an accelerator: parity with HF there, and eager decode timing.

The core is hardware-neutral: the pure-PyTorch reference ops run on any torch device.  This
script (run on a CUDA machine) builds the parity tests' tiny random model, runs it with
``backend="reference"`` (or ``--backend NAME``), ``device="cuda"`` and checks, on the GPU:

- full-prompt logits against HF ``DeepseekV4ForCausalLM`` on the same device (fp32);
- greedy generation through the engine (continuous batching, chunked prefill, prefix
  caching, async scheduling with device-side token feedback) against HF ``generate``;
- the wall time of an eager decode step at batch 64 (no CUDA graphs, no custom kernels:
  the baseline the ``cuda_sm100`` kernels must beat).

Prints a table and writes JSON (``benchmarks/results/gpu_reference_check.json``)::

    python benchmarks/gpu_reference_check.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.backends import resolve_backend  # noqa: E402
from deepinfer_core.config import EngineConfig  # noqa: E402
from deepinfer_core.contract.batch import SeqChunk  # noqa: E402
from deepinfer_core.engine.model_runner import ModelRunner  # noqa: E402
from deepinfer_core.ops import OpTable  # noqa: E402
from tests.models.hf_oracle import CONFIGS, build_hf_model, save_hf_model  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "gpu_reference_check.json"


def _check_config(name: str, device: str, work: Path, backend: str = "reference") -> dict:
    model = build_hf_model(name)
    path = save_hf_model(model, work / name)
    model = model.to(device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 300, (83,), generator=g).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids], device=device)).logits[0].float()
    cfg = EngineConfig(model=str(path), dtype="float32", device=device, max_num_seqs=4, page_size=16)
    runner = ModelRunner.load(path, cfg, resolve_backend(backend)[1])
    pages = runner.kv_cache.allocate_pages(runner.kv_cache.pages_needed(len(ids)))
    ours = torch.cat(
        [
            runner.execute([SeqChunk(0, ids[s : s + 13], s, pages, sample=True, all_logits=True)])
            for s in range(0, len(ids), 13)
        ]
    )
    logit_err = float((ours - ref).abs().max())

    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (3, 17, 33, 58, 70)]
    llm = LLM(
        model=str(path),
        backend=backend,
        device=device,
        dtype="float32",
        max_num_seqs=3,
        max_num_batched_tokens=24,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        use_tqdm=False,
    )
    model.generation_config.eos_token_id = None
    same = 0
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = model.generate(
                torch.tensor([p], device=device), max_new_tokens=24, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
        same += out.outputs[0].token_ids == want
    return {
        "config": name,
        "backend": backend,
        "max_logit_err": logit_err,
        "greedy_equal": f"{same}/{len(prompts)}",
        "graphs": sorted(llm.engine.runner.graph_manager.graphs("decode")),
    }


def _decode_step_ms(device: str, work: Path, batch: int = 64) -> float:
    path = save_hf_model(build_hf_model("all_types"), work / "timing")
    cfg = EngineConfig(model=str(path), dtype="float32", device=device, max_num_seqs=batch, page_size=16)
    runner = ModelRunner.load(path, cfg, OpTable.reference())
    tables = [runner.kv_cache.allocate_pages(runner.kv_cache.pages_needed(128)) for _ in range(batch)]
    ids = torch.randint(2, 300, (batch, 32))
    runner.execute([SeqChunk(i, ids[i].tolist(), 0, tables[i]) for i in range(batch)])
    chunks = [SeqChunk(i, [5], 32, tables[i]) for i in range(batch)]
    for _ in range(3):
        runner.execute(chunks)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        runner.execute(chunks)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 20 * 1000


def main(argv: list[str] | None = None) -> int:
    """Run the checks on ``--device``; print a table; write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="reference", help="the DeepInfer backend to check against HF")
    ap.add_argument("--skip-timing", action="store_true", help="leave out the eager decode-step timing")
    ap.add_argument("--output", default=str(RESULTS))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [_check_config(name, args.device, Path(tmp), args.backend) for name in sorted(CONFIGS)]
        step_ms = None if args.skip_timing else _decode_step_ms(args.device, Path(tmp))
    print(f"{'config':18s} {'max |logit err|':>16s} {'greedy == HF':>13s}")
    for r in rows:
        print(f"{r['config']:18s} {r['max_logit_err']:16.2e} {r['greedy_equal']:>13s}")
    if step_ms is not None:
        print(f"eager reference decode step, batch 64, tiny model: {step_ms:.2f} ms")
    report = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "checks": rows,
        "decode_step_ms_batch64": step_ms,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
