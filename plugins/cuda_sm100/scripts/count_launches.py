"""Kernel launches per decode step on the ``cuda_sm100`` op table, counted on a CPU.

The engine runs ``--model`` (default: the built-in tiny DeepSeek-V4) eagerly on every op of the
``cuda_sm100`` table with its Triton kernels in Triton's CPU interpreter (``TRITON_INTERPRET=1``,
set here before Triton is imported), admits ``--batch`` requests of ``--prompt-len`` random ids,
steps until every request decodes, then counts one decode step's launches: each Triton kernel
launch, and each PyTorch operator that launches a kernel on a GPU (views, allocations and
scalar reads left out, as ``profile_step.py --sites`` counts them), those by the DeepInfer
source line calling them.  A GPU runs the same code
path, so the counts are the GPU step's, but for what differs by device: cuBLAS may add a
split-K reduction to a GEMM, and TileLang kernels (GPU only) replace some Triton ones one for
one.  A CUDA graph replays the same launches.

``--decompose OPS`` removes those fused ops from the table, so the engine runs them as their
decompositions (the kernels of their parts): the launches the fusion saves.

The blocks' independent chains run as a GPU runs them at decode sizes, on two streams
(:mod:`deepinfer_core.ops.overlap`; here each chain deferred to its join, the same launches):
besides the total, the launches on the step's *critical path* -- those outside any branch, plus
for each branch the more of its chain's launches and of the current stream's between its fork
and its join -- which bound a one-token step whose kernels each cost about their latency.
``--one-stream`` runs every chain inline (``DEEPINFER_STREAM_OVERLAP=0``).

    python plugins/cuda_sm100/scripts/count_launches.py
    python plugins/cuda_sm100/scripts/count_launches.py --decompose hc_post_pre,qk_norm_rope
    python plugins/cuda_sm100/scripts/count_launches.py --one-stream
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported (the kernel modules import it)
os.environ["DEEPINFER_TEST_DEFER_BRANCHES"] = "1"  # the CPU's branches overlapped, as a GPU's are

BACKEND = "cuda_sm100_interpreted"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the built-in tiny model)")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together (default 1)")
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--decompose", default="", help="comma-separated fused ops left to their decomposition")
    p.add_argument("--top", type=int, default=25, help="launch sources listed (default 25)")
    p.add_argument("--one-stream", action="store_true", help="the blocks' chains inline (no overlap)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/count_launches.json"))
    a = p.parse_args(argv)
    if a.batch < 1 or a.prompt_len < 1:
        p.error(f"--batch {a.batch} / --prompt-len {a.prompt_len}: give counts >= 1")
    return a


def _plugin(decompose: set[str]):
    """A plugin registering the CPU backend :data:`BACKEND`: the interpreted ``cuda_sm100`` table
    less the ``decompose`` ops."""
    from deepinfer_cuda_sm100.ops import load_ops

    from deepinfer_core.backends import BackendSpec
    from deepinfer_core.hookspecs import hookimpl
    from deepinfer_core.ops import all_ops

    unknown = sorted(n for n in decompose if all_ops().get(n) is None or all_ops()[n].decomposition is None)
    if unknown:
        fused = sorted(n for n, op in all_ops().items() if op.decomposition is not None)
        raise SystemExit(f"--decompose: {unknown} are not fused ops with a decomposition; they are {fused}")

    def ops():
        return {name: impl for name, impl in load_ops().items() if name not in decompose}

    class Interpreted:
        @hookimpl
        def deepinfer_register_backends(self, register):
            register(BackendSpec(BACKEND, "cpu", priority=1, ops=ops))

    return Interpreted()


def decoding_engine(a: argparse.Namespace, decompose: set[str]):
    """An eager engine on :data:`BACKEND` whose ``--batch`` requests all decode."""
    from deepinfer_core import SamplingParams
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.testing import manager_with_plugin

    config = EngineConfig(
        backend=BACKEND,
        max_num_seqs=a.batch,
        max_model_len=a.prompt_len + 16,
        enforce_eager=True,
        kv_cache_dtype=a.kv_cache_dtype,
        **({"model": a.model} if a.model else {}),
    )
    engine = LLMEngine(config, plugins=manager_with_plugin(_plugin(decompose), BACKEND))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(a.batch):
        engine.add_request(f"p{i}", [rng.randrange(4, vocab) for _ in range(a.prompt_len)], params)
    running = engine.scheduler.running
    for _ in range(a.batch * a.prompt_len + 16):
        if len(running) == a.batch and all(r.output_token_ids for r in running):
            break
        engine.step()
    engine.step()  # one decode step first (lazily built state)
    return engine


def _site() -> str:
    """The innermost DeepInfer source line on the stack (``path:line function``)."""
    frame = sys._getframe(2)
    while frame is not None and "/deepinfer_" not in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    return f"{path[path.rfind('/deepinfer_') + 1 :]}:{frame.f_lineno} {frame.f_code.co_name}"


class CriticalPath:
    """A step's launches by where they run when its blocks' chains overlap: outside any branch,
    or per branch on the current stream between its fork and its join (``main``) and in its chain
    (``side``); the critical path takes the more of the two for each branch (a launch of the
    current stream inside nested branches counts for the innermost)."""

    def __init__(self) -> None:
        self.outside = 0
        self.branches: dict[object, list[int]] = {}  # branch -> [main, side] (held: ids get reused)
        self.open: list[list[int]] = []
        self.running: list[list[int]] = []

    def event(self, event: str, branch: object) -> None:
        """An :func:`~deepinfer_core.ops.overlap.observe_branches` event."""
        if event == "fork":
            self.branches[branch] = counts = [0, 0]
            self.open.append(counts)
        elif event == "chain":
            self.running.append(self.branches[branch])
        elif event == "end":
            self.running.pop()
        elif event == "join":
            self.open.remove(self.branches[branch])

    def launch(self) -> None:
        if self.running:
            self.running[-1][1] += 1
        elif self.open:
            self.open[-1][0] += 1
        else:
            self.outside += 1

    @property
    def critical(self) -> int:
        return self.outside + sum(max(main, side) for main, side in self.branches.values())


def count_step(engine) -> tuple[Counter, Counter, Counter, CriticalPath]:
    """One engine step's Triton launches by kernel, its GPU-launching PyTorch operators by name
    and by calling source line, and where they run (:class:`CriticalPath`)."""
    import triton.runtime.interpreter as interpreter
    from profile_step import NO_KERNEL
    from torch.utils._python_dispatch import TorchDispatchMode

    from deepinfer_core.ops.overlap import observe_branches

    kernels: Counter = Counter()
    operators: Counter = Counter()
    sites: Counter = Counter()
    path = CriticalPath()

    class Operators(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in NO_KERNEL and not interpreting[0]:
                operators[name] += 1
                sites[f"{name} @ {_site()}"] += 1
                path.launch()
            return func(*args, **(kwargs or {}))

    interpreting = [False]  # the interpreter's own tensor work is not a launch
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        kernels[self.fn.__name__] += 1
        path.launch()
        interpreting[0] = True
        try:
            return run(self, *args, **kwargs)
        finally:
            interpreting[0] = False

    interpreter.InterpretedFunction.run = counted
    try:
        with Operators(), observe_branches(path.event):
            engine.step()
    finally:
        interpreter.InterpretedFunction.run = run
    return kernels, operators, sites, path


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    decompose = {n for n in a.decompose.split(",") if n}
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # profile_step's NO_KERNEL
    if a.one_stream:
        os.environ["DEEPINFER_STREAM_OVERLAP"] = "0"
    engine = decoding_engine(a, decompose)
    kernels, operators, sites, path = count_step(engine)
    total = sum(kernels.values()) + sum(operators.values())
    result = {
        "model": a.model or "built-in tiny",
        "batch": a.batch,
        "kv_cache_dtype": a.kv_cache_dtype,
        "decomposed": sorted(decompose),
        "layers": engine.model_config.num_hidden_layers,
        "launches_per_step": total,
        "triton_launches": sum(kernels.values()),
        "torch_operators": sum(operators.values()),
        "one_stream": a.one_stream,
        "critical_path_launches": path.critical,
        "branches": len(path.branches),
        "triton_by_kernel": dict(kernels.most_common()),
        "torch_by_operator": dict(operators.most_common()),
        "torch_by_site": dict(sites.most_common()),
    }
    decomposed = sorted(decompose) or "none"
    print(
        f"decode step, batch {a.batch}, {result['layers']} layers, decomposed: {decomposed}: {total} "
        f"launches ({result['triton_launches']} Triton, {result['torch_operators']} PyTorch operators); "
        f"{path.critical} on the critical path ({len(path.branches)} branches on a second stream)"
    )
    for name, n in (kernels + operators).most_common(a.top):
        print(f"  {n:4d}  {name}")
    print("PyTorch operators by calling line:")
    for name, n in sites.most_common(a.top):
        print(f"  {n:4d}  {name}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
