"""``scripts/ncu_stalls.py``: the warp-stall summary of an Nsight Compute source-page export.

The export is written here in ncu's own layout (the kernel line, the column names, one row an
instruction, thousands separators, the not-issued twin of each stall column); the summary's
totals must equal the sums of the rows, and the hot spots come with the instructions before them.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ncu_stalls.py"


def _module():
    spec = importlib.util.spec_from_file_location("ncu_stalls", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ncu_stalls"] = mod  # its dataclass resolves its annotations through it
    spec.loader.exec_module(mod)
    return mod


ROWS = [  # address, source, samples, executed, long_sb, barrier, lg
    ("0x10", "LDG.E R8, desc[UR18][R6.64]", "3", "10,240", "0", "0", "3"),
    ("0x20", "IADD3 R16, P1, R16, 0x40, RZ", "1", "10,240", "0", "0", "0"),
    ("0x30", "SHF.R.S32.HI R7, RZ, 0x1f, R8", "1,348", "10,240", "1,346", "0", "2"),
    ("0x40", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R7+UR12+0x8], R8", "0", "10,240", "0", "0", "0"),
    ("0x50", "@!P0  BRA 0x7f80", "915", "10,240", "915", "0", "0"),
    ("0x60", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "232", "10,240", "0", "231", "1"),
]


def _export(path: Path) -> Path:
    reasons = ["stall_long_sb", "stall_barrier", "stall_lg"]
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
    header += reasons + [f"{r} (Not Issued)" for r in reasons]
    with path.open("w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "sparse_attention_decode_ws_kernel"])
        w.writerow(header)
        for row in ROWS:
            w.writerow([*row, "9", "9", "9"])  # the not-issued columns must not count
    return path


def test_totals_are_the_sums_of_the_rows(tmp_path):
    mod = _module()
    kernel, instructions = mod.read_report(_export(tmp_path / "r.csv"))
    assert kernel == "sparse_attention_decode_ws_kernel" and len(instructions) == len(ROWS)
    reasons = mod.by_reason(instructions)
    assert reasons == {"long_sb": 2261.0, "barrier": 231.0, "lg": 6.0}
    assert list(reasons) == ["long_sb", "barrier", "lg"]  # most first
    assert sum(i.samples for i in instructions) == 2499.0


def test_hot_spots_rank_by_samples_with_their_context(tmp_path):
    mod = _module()
    _, instructions = mod.read_report(_export(tmp_path / "r.csv"))
    spots = mod.hot_spots(instructions, top=2, context=2)
    assert [s["address"] for s in spots] == ["0x30", "0x50"]
    assert spots[0]["leading"] == [("long_sb", 1346.0), ("lg", 2.0)]
    assert spots[0]["before"] == ["0x10 LDG.E R8, desc[UR18][R6.64]", "0x20 IADD3 R16, P1, R16, 0x40, RZ"]
    first = mod.hot_spots(instructions, top=6, context=3)[-1]
    assert first["samples"] == 0.0 and first["address"] == "0x40"  # the first of equal rows last
    assert mod.hot_spots(instructions, top=1, context=5)[0]["before"][0].startswith("0x10")


def test_main_prints_and_writes_json(tmp_path, capsys):
    mod = _module()
    out = tmp_path / "s.json"
    assert mod.main([str(_export(tmp_path / "r.csv")), "--top", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2499 warp-stall samples" in text and "long_sb" in text and "SHF.R.S32.HI" in text
    data = json.loads(out.read_text())
    assert data["samples"] == 2499.0 and data["hot"][0]["address"] == "0x30"


@pytest.mark.parametrize("content", ["", "Kernel Name,k\nAddress,Source\n0x10,NOP\n"])
def test_an_export_without_samples_is_one_error_line(tmp_path, capsys, content):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    assert _module().main([str(path)]) == 2
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("error: ") and "bad.csv" in line
