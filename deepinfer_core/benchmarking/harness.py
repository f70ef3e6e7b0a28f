"""The benchmark scripts' shared harness: flags, prompts, timing, machine info, JSON (with a
``"run_info"`` entry: :func:`write_json`) and tables; the scripts measure, ``tests/`` judges."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from deepinfer_core.errors import DeepInferError, user_error_line

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
"""Where the benchmarks write their JSON by default."""


def log(msg: str) -> None:
    """Print ``msg`` with the wall-clock time, flushed (progress lines of a long run)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_main(main: Callable[[], Any]) -> None:
    """Run a benchmark script's ``main``: an ``int`` result is the exit status; bad input (a
    :class:`~deepinfer_core.errors.DeepInferError`, or a path that cannot be read or written)
    ends it with one ``error:`` line and status 2, as the ``deepinfer`` command does."""
    try:
        result = main()
    except (DeepInferError, OSError) as e:
        print(user_error_line(e), file=sys.stderr)
        sys.exit(2)
    sys.exit(result if isinstance(result, int) else 0)


def positive_ints(text: str) -> list[int]:
    """``argparse`` type: comma-separated positive integers (``"1,16,64"``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """``argparse`` type: a non-empty comma-separated list of ``choices`` (``"decode,cp"``)."""

    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in values if x not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(choices)}")
        return values

    return parse


KEEP_QUANTIZED = {"auto": None, "on": True, "off": False}
"""``--keep-quantized`` choices and the ``LLM(keep_quantized=...)`` each gives."""


def add_keep_quantized(parser: argparse.ArgumentParser, help: str) -> None:
    """``--keep-quantized auto|on|off`` (default ``auto``; :data:`KEEP_QUANTIZED` maps it)."""
    parser.add_argument("--keep-quantized", choices=tuple(KEEP_QUANTIZED), default="auto", help=help)


def parser(doc: str, name: str, threads: int | None = 1, **ints: int) -> argparse.ArgumentParser:
    """A benchmark's parser: ``doc``'s first paragraph as description, ``--output`` (alias
    ``--out``, ``--json``; default ``benchmarks/results/NAME.json``), unless ``threads`` is
    ``None`` ``--threads`` (torch intra-op threads, default ``threads``; 0: torch's default), and
    an integer flag per keyword of ``ints`` (``prompt_len=32``: ``--prompt-len``, default 32)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0] + " (docs/benchmarks.md)")
    out = RESULTS_DIR / f"{name}.json"
    ap.add_argument("--output", "--out", "--json", type=Path, default=out, help=f"JSON (default {out})")
    if threads is not None:
        ap.add_argument("--threads", type=int, default=threads, help=f"torch threads (default {threads})")
    for key, default in ints.items():
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=default, help=f"(default {default})")
    return ap


def parse(ap: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``ap.parse_args(argv)``, then torch's thread count set from ``--threads`` (when not 0)."""
    args = ap.parse_args(argv)
    if getattr(args, "threads", 0):
        import torch

        torch.set_num_threads(args.threads)
    return args


def greedy(max_tokens: int, **kw: Any) -> Any:
    """``SamplingParams``: greedy, exactly ``max_tokens`` new tokens (EOS ignored), plus ``kw``."""
    from deepinfer_core import SamplingParams

    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **kw})


def generate(llm: Any, prompts: Sequence[Sequence[int]], params: Any) -> tuple[list[Any], float]:
    """``(outputs, seconds)`` of one ``llm.generate`` over token-id ``prompts``."""
    reqs = [{"prompt_token_ids": list(p)} for p in prompts]
    return timed(lambda: llm.generate(reqs, params, use_tqdm=False))


def new_tokens(outputs: Sequence[Any]) -> int:
    """Tokens generated over ``outputs`` (first completion of each)."""
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def random_prompts(num: int, length: int, seed: int = 0, high: int = 500) -> list[list[int]]:
    """``num`` seeded prompts of ``length`` random ids in ``[4, high)``."""
    rng = random.Random(seed)
    return [[rng.randrange(4, high) for _ in range(length)] for _ in range(num)]


def corpus_prompts(tok: Any, num: int, length: int, mixed: bool = False, seed: int = 0) -> list[list[int]]:
    """``num`` prompts: BOS, then windows of the tiny model's corpus; ``length`` tokens each, or
    with ``mixed`` seeded lengths from ``length // 4`` to ``2 * length``."""
    text = (Path(__file__).parents[1] / "models/deepseek_v4/tiny_corpus.txt").read_text(encoding="utf-8")
    ids, rng = tok.encode(text, add_bos=False), random.Random(seed)
    lengths = [rng.randint(max(1, length // 4), 2 * length) if mixed else length for _ in range(num)]
    return [[tok.bos_token_id, *ids[(i * 97) % (len(ids) - n) :][: n - 1]] for i, n in enumerate(lengths)]


def hf_generate(
    model: Any, prompts: Sequence[Sequence[int]], new_tokens: int, sync: Callable[[], None] | None = None
) -> tuple[list[list[int]], float, list[float]]:
    """HF transformers' greedy ``model.generate`` of exactly ``new_tokens`` tokens after each of the
    token-id ``prompts`` (the model's ``generation_config.eos_token_id`` set to ``None``): ``(new
    ids, seconds, stamps)``, ``stamps`` the seconds from the start to each step's logits; ``sync``
    as :func:`timed`'s (also before each stamp)."""
    import torch
    from transformers import LogitsProcessorList

    sync, stamps = sync or (lambda: None), []
    clock = lambda ids, scores: (sync(), stamps.append(time.perf_counter()), scores)[-1]  # noqa: E731
    ids = torch.tensor(prompts, dtype=torch.long, device=model.device)
    kw = {"attention_mask": torch.ones_like(ids), "logits_processor": LogitsProcessorList([clock])}
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kw)
    sync()
    seconds, new = time.perf_counter() - t0, out[:, ids.shape[1] :].tolist()
    if any(len(t) != new_tokens for t in new):
        raise RuntimeError(f"HF generated {[len(t) for t in new]} tokens, expected {new_tokens}")
    return new, seconds, [t - t0 for t in stamps]


def timed(fn: Callable[[], Any], sync: Callable[[], None] | None = None) -> tuple[Any, float]:
    """``(fn(), seconds)`` by ``time.perf_counter``; ``sync`` (e.g. ``torch.cuda.synchronize``)
    runs before the clock starts and before it stops."""
    sync = sync or (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def machine_info(device: Any = None) -> dict[str, Any]:
    """Where and how a benchmark ran: device (GPU name, capability, memory), torch / triton /
    transformers / DeepInfer versions, Python, platform, CPU count, command line and date."""
    import deepinfer_core

    info: dict[str, Any] = {
        "device": str(device) if device is not None else "cpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "deepinfer": deepinfer_core.__version__,
    }
    torch = sys.modules.get("torch")  # a torch-free script (the cost model) stays torch-free
    if torch is not None:
        info |= {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
        info["torch_threads"] = torch.get_num_threads()
    dev = torch.device(device) if torch is not None and device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(dev)
        info |= {"gpu": torch.cuda.get_device_name(dev), "gpu_capability": f"{props.major}.{props.minor}"}
        info |= {"gpu_memory_gib": props.total_memory / 2**30, "gpu_count": torch.cuda.device_count()}
    for mod in ("triton", "transformers", "safetensors", "llguidance"):
        try:
            info[mod] = __import__(mod).__version__ if torch is not None else None
        except Exception:  # not installed (or broken): recorded as absent
            info[mod] = None
    return info


def write_json(path: Path | str, report: dict[str, Any], device: Any = None, quiet: bool = False) -> Path:
    """Write ``report`` plus ``"run_info"`` (:func:`machine_info`) to ``path`` (folders made,
    written whole through a temporary file; ``quiet``: without the ``wrote PATH`` line);
    returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**report, "run_info": machine_info(device)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)
    if not quiet:
        print(f"wrote {path}")
    return path


def print_table(rows: Sequence[dict[str, Any]], columns: str | Sequence[tuple[str, str, str]]) -> None:
    """Print ``rows`` aligned: ``columns`` are ``(header, key, format spec)``, or one string of
    ``key:spec`` words (the key is the header); a missing or ``None`` value prints as ``-``."""
    if isinstance(columns, str):
        columns = [(key, key, spec) for key, _, spec in (word.partition(":") for word in columns.split())]
    cells = [["-" if r.get(key) is None else format(r[key], spec) for _, key, spec in columns] for r in rows]
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, (h, _, _) in enumerate(columns)]
    for line in [[h for h, _, _ in columns], *cells]:
        print("  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True)))
