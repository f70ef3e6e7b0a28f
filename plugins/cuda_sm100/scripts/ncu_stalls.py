"""Where a kernel's warps stall, instruction by instruction, from an Nsight Compute report.

Reads the SASS source page of a report profiled with the ``SourceCounters`` section, exported
as CSV::

    ncu --clock-control none --section SourceCounters --section WarpStateStats \\
        -k regex:decode_ws --launch-skip 1 --launch-count 1 -o ws python bench_attention.py ...
    ncu --import ws.ncu-rep --page source --print-source sass --csv > ws_sass.csv
    python plugins/cuda_sm100/scripts/ncu_stalls.py ws_sass.csv --top 12 --context 6

and prints the warp-stall samples by reason over the whole kernel, then the ``--top``
instructions with the most samples, each with its two leading reasons and the ``--context``
instructions before it (a wait's culprit is usually the instruction that produced the value
it waits for: e.g. a sign extension right after an ``LDG`` waits for the load, a ``BRA`` after
an mbarrier ``TRYWAIT`` spins on an empty or full slot).  ``--json`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
"""The column of a row's warp-stall samples, issued or not."""
EXECUTED = "Instructions Executed"
"""The column of a row's warp-level executions."""


@dataclass
class Instruction:
    """One SASS instruction of the report: its address, text, samples and executions, and its
    samples by stall reason (``stall_<reason>``, not-issued columns left out)."""

    address: str
    source: str
    samples: float
    executed: float
    stalls: dict[str, float] = field(default_factory=dict)

    def leading(self, n: int = 2) -> list[tuple[str, float]]:
        """The ``n`` reasons with the most samples, most first (reasons without samples left out)."""
        ranked = sorted(self.stalls.items(), key=lambda kv: -kv[1])
        return [(reason, count) for reason, count in ranked[:n] if count > 0]


def _number(text: str) -> float:
    """A CSV cell as a number (thousands separators dropped; an empty or text cell is 0)."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_report(path: Path) -> tuple[str, list[Instruction]]:
    """``(kernel name, instructions in address order)`` of a ``--page source --csv`` export: its
    first line names the kernel, its second holds the column names.  Raises ``ValueError`` when
    the file lacks the sampling columns (profiled without ``--section SourceCounters``)."""
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2:
        raise ValueError(f"{path}: not an ncu source-page CSV (fewer than two lines)")
    kernel = rows[0][1] if len(rows[0]) > 1 else "?"
    header = rows[1]
    if SAMPLES not in header or "Address" not in header:
        raise ValueError(f"{path}: no {SAMPLES!r} column; profile with --section SourceCounters")
    col = {name: i for i, name in enumerate(header)}
    reasons = [n for n in header if n.startswith("stall_") and not n.endswith("(Not Issued)")]
    out = []
    for row in rows[2:]:
        if len(row) < len(header):
            continue
        stalls = {r.removeprefix("stall_"): _number(row[col[r]]) for r in reasons}
        cells = (_number(row[col[SAMPLES]]), _number(row[col[EXECUTED]]) if EXECUTED in col else 0.0)
        out.append(Instruction(row[col["Address"]], row[col["Source"]].strip(), *cells, stalls))
    return kernel, out


def by_reason(instructions: list[Instruction]) -> dict[str, float]:
    """Samples by stall reason over every instruction, most first."""
    totals: dict[str, float] = {}
    for ins in instructions:
        for reason, count in ins.stalls.items():
            totals[reason] = totals.get(reason, 0.0) + count
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def hot_spots(instructions: list[Instruction], top: int, context: int) -> list[dict]:
    """The ``top`` instructions with the most samples, most first, each as ``{address, source,
    samples, executed, leading, before}`` with the ``context`` instructions before it."""
    ranked = sorted(range(len(instructions)), key=lambda i: -instructions[i].samples)[:top]
    spots = []
    for i in ranked:
        ins = instructions[i]
        before = [f"{b.address} {b.source}" for b in instructions[max(0, i - context) : i]]
        spots.append({"address": ins.address, "source": ins.source, "samples": ins.samples,
                      "executed": ins.executed, "leading": ins.leading(), "before": before})  # fmt: skip
    return spots


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", type=Path, help="ncu --import R --page source --print-source sass --csv output")
    p.add_argument("--top", type=int, default=12, help="instructions to list (default 12)")
    p.add_argument("--context", type=int, default=4, help="instructions shown before each (default 4)")
    p.add_argument("--json", type=Path, help="write the summary here")
    a = p.parse_args(argv)
    try:
        kernel, instructions = read_report(a.csv)
    except (OSError, ValueError) as e:
        print(f"error: {e}")
        return 2
    total = sum(ins.samples for ins in instructions) or 1.0
    reasons = by_reason(instructions)
    spots = hot_spots(instructions, a.top, a.context)
    print(f"{kernel}: {len(instructions)} instructions, {total:.0f} warp-stall samples")
    for reason, count in list(reasons.items())[:10]:
        print(f"  {reason:20s} {count:8.0f}  {100 * count / total:5.1f} %")
    for spot in spots:
        lead = ", ".join(f"{r} {c:.0f}" for r, c in spot["leading"])
        print(
            f"\n{spot['samples']:6.0f} ({100 * spot['samples'] / total:4.1f} %)  {spot['source']}  [{lead}]"
        )
        for line in spot["before"]:
            print(f"         {line}")
    if a.json:
        a.json.write_text(
            json.dumps({"kernel": kernel, "samples": total, "by_reason": reasons, "hot": spots})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
