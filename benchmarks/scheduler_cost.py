"""The scheduler's host time per decode step: `Scheduler.schedule` and `Scheduler.complete` at a
full decode batch, the real scheduler and page allocator with no model (async scheduling's order:
step N + 1 scheduled before step N's tokens are completed).

At large batches an accelerator's decode step can be shorter than the host's Python work for it;
this is the scheduler's part of that work, per step and per request.
"""

from __future__ import annotations

import statistics
import time

from deepinfer_core.benchmarking import harness as h
from deepinfer_core.engine.kv_cache import KVCacheManager
from deepinfer_core.engine.request import Request
from deepinfer_core.engine.scheduler import Scheduler
from deepinfer_core.sampling.params import SamplingParams

PAGE_SIZE = 64


def decoding_scheduler(batch: int, prompt_len: int, steps: int) -> Scheduler:
    """A scheduler whose ``batch`` requests (prompts of ``prompt_len``) have all prefilled and
    decode for at least ``steps`` more steps."""
    budget = max(8192, batch)
    new = steps + 8 + -(-batch * prompt_len // budget)  # the first prompts decode while others prefill
    pages = batch * -(-(prompt_len + new) // PAGE_SIZE)
    kv = KVCacheManager(num_pages=pages, page_size=PAGE_SIZE, num_slots=batch)
    sched = Scheduler(kv, batch, budget, max_model_len=prompt_len + new + 1)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for i in range(batch):
        sched.add(Request(f"r{i}", [(i * 31 + j * 7) % 1000 for j in range(prompt_len)], params))
    while not (len(sched.running) == batch and all(r.output_token_ids for r in sched.running)):
        out = sched.schedule()  # the prefill, synchronously
        sched.complete(out, [5] * out.num_sampling, [None] * out.num_sampling, [])
    return sched


def measure(batch: int, prompt_len: int, steps: int) -> dict:
    """Median ``schedule`` and ``complete`` times over ``steps`` async decode steps."""
    sched = decoding_scheduler(batch, prompt_len, steps)
    scheduled, completed = [], []
    previous = sched.schedule()
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        sched.complete(previous, [7] * previous.num_sampling, [None] * previous.num_sampling, [])
        completed.append(time.perf_counter() - t1)
        scheduled.append(t1 - t0)
        if len(out.chunks) != batch or out.num_tokens != batch:
            raise RuntimeError(f"a decode step scheduled {len(out.chunks)} chunks, not {batch}")
        previous = out
    schedule_ms, complete_ms = 1e3 * statistics.median(scheduled), 1e3 * statistics.median(completed)
    total = schedule_ms + complete_ms
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps, "schedule_ms": schedule_ms,
            "complete_ms": complete_ms, "total_ms": total, "us_per_request": 1e3 * total / batch}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = h.parser(__doc__, "scheduler_cost", threads=None, prompt_len=512, steps=200, repeats=3)
    ap.add_argument("--batch-sizes", type=h.positive_ints, default=[1, 64, 256], help="(default 1,64,256)")
    args = h.parse(ap, argv)
    rows = []
    for batch in args.batch_sizes:  # the best of the repeats (each a fresh scheduler)
        runs = [measure(batch, args.prompt_len, args.steps) for _ in range(args.repeats)]
        rows.append(min(runs, key=lambda r: r["total_ms"]))
    h.print_table(rows, "batch:d schedule_ms:.3f complete_ms:.3f total_ms:.3f us_per_request:.2f")
    h.write_json(args.output, {"args": vars(args) | {"output": str(args.output)}, "results": rows})


if __name__ == "__main__":
    h.run_main(main)
