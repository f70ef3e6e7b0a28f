"""``scripts/sass_loads.py``: each global load's distance to its first reader, on SASS listings
in ``cuobjdump -sass``'s layout whose distances are counted by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import sass_loads  # noqa: E402


def listing(*functions: tuple[str, list[str]]) -> str:
    """A ``cuobjdump -sass`` listing: a header, then each function's instructions with addresses
    and encodings as the tool prints them."""
    out = ["", "Fatbin elf code:", "================", "arch = sm_90a", ""]
    for name, code in functions:
        out += ["\tcode for sm_90a", f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"']
        for k, text in enumerate(code):
            address = f"{16 * k:04x}"
            out += [
                f"        /*{address}*/                   {text} ;   /* 0x000000ff00007986 */",
                "        /* 0x000fe20000000f00 */",
            ]
    return "\n".join(out) + "\n"


PRODUCER = [
    "LDG.E R4, desc[UR18][R2.64]",  # 0: read by the sign extension 2 later
    "IADD3 R7, R7, 0x1, RZ",
    "SHF.R.S32.HI R5, RZ, 0x1f, R4",
    "LDG.E.64 R8, desc[UR18][R2.64+0x8]",  # 3: R8, R9; the LDGSTS reads R8 2 later
    "MOV R10, UR18",  # UR18 is a uniform register, not R18
    "LDGSTS.E.BYPASS.128 [R11+0x1f000], desc[UR18][R8.64]",  # not a register load
    "STG.E desc[UR18][R2.64], R9",
    "LDG.E R12, desc[UR18][R2.64]",  # 7: overwritten before any read
    "MOV R12, RZ",
    "LDG.E R13, desc[UR18][R2.64]",  # 9: read after a branch
    "@!P0 BRA 0x40",
    "IMAD.WIDE R2, R13, 0x4, R2",
    "EXIT",
]


def test_each_load_gets_its_first_reader_in_program_order():
    ((name, report),) = sass_loads.report(listing(("k", PRODUCER)), near=32).items()
    assert name == "k" and report["instructions"] == len(PRODUCER)
    got = {ld.address: (ld.registers, ld.distance, ld.branch_between) for ld in report["loads"]}
    assert got == {
        "0000": ([4], 2, False),
        "0030": ([8, 9], 2, False),  # the LDGSTS reads R8 as its source address
        "0070": ([12], None, False),
        "0090": ([13], 2, True),
    }
    assert [ld.address for ld in report["near"]] == ["0000", "0030"]
    assert report["loads"][0].reader == "SHF.R.S32.HI R5, RZ, 0x1f, R4"


def test_near_and_branches_decide_what_is_exposed():
    code = ["LDG.E R4, desc[UR4][R2.64]", *["NOP"] * 5, "IADD3 R6, R4, 0x1, RZ"]
    (report,) = sass_loads.report(listing(("k", code)), near=6).values()
    assert [ld.distance for ld in report["near"]] == [6]
    (report,) = sass_loads.report(listing(("k", code)), near=5).values()
    assert report["near"] == [] and report["loads"][0].distance == 6
    waited = ["LDG.E R4, desc[UR4][R2.64]", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R8+UR12], R9", "MOV R5, R4"]
    (report,) = sass_loads.report(listing(("k", waited)), near=32).values()
    assert report["loads"][0].branch_between and report["near"] == []


def test_predicates_and_wide_operands_are_read_as_registers():
    assert sass_loads.operands("@!P0 LDG.E R6, desc[UR18][R4.64+0x20]") == (
        "LDG.E",
        ["R6", "desc[UR18][R4.64+0x20]"],
    )
    assert sass_loads.registers_of("desc[UR18][R4.64+0x20]") == [4, 5]
    assert sass_loads.registers_of("RZ") == [] and sass_loads.registers_of("R8.128") == [8, 9, 10, 11]
    assert sass_loads.written_and_read("STG.E.128 desc[UR4][R2.64], R8") == (set(), {2, 3, 8})


def test_functions_are_reported_apart_and_as_json(tmp_path, capsys):
    path = tmp_path / "k.sass"
    path.write_text(listing(("a", PRODUCER), ("b", ["LDG.E R1, desc[UR4][R2.64]", "EXIT"])))
    assert sass_loads.main([str(path), "--json", str(tmp_path / "k.json")]) == 0
    out = capsys.readouterr().out
    assert "a: 13 instructions, 4 register loads, 2 exposed" in out and "b: 2 instructions, 1 register" in out
    data = json.loads((tmp_path / "k.json").read_text())
    assert [ld["distance"] for ld in data["a"]["loads"]] == [2, 2, None, 2]
    assert data["b"]["loads"][0]["distance"] is None


@pytest.mark.parametrize("text", ["", "not a listing\n"])
def test_a_file_without_sass_is_one_error_line(tmp_path, capsys, text):
    path = tmp_path / "empty.sass"
    path.write_text(text)
    assert sass_loads.main([str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds no SASS function" in err


def test_a_cubin_without_cuobjdump_is_one_error_line(tmp_path, monkeypatch):
    path = tmp_path / "kernel.cubin"
    path.write_bytes(b"\x7fELF")
    monkeypatch.setattr(sass_loads.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as stop:
        sass_loads.main([str(path)])
    message = str(stop.value)
    assert message.startswith("error: ") and "cuobjdump is not on PATH" in message and "\n" not in message
