"""How far each global load of a kernel runs ahead of its first use, read from its SASS.

No GPU is needed: the SASS comes from ``cuobjdump -sass`` of a cubin, which a CPU machine with
the CUDA toolkit builds (TileLang kernels: ``DEEPINFER_TILELANG_ARCH=9.0``, whose disk cache
holds each kernel's ``kernel.cubin``)::

    cuobjdump -sass kernel.cubin > k.sass
    python plugins/cuda_sm100/scripts/sass_loads.py k.sass --near 8
    python plugins/cuda_sm100/scripts/sass_loads.py kernel.cubin      # runs cuobjdump itself

For each function it prints its instruction count and each register-destination global load
(``LDG``) with the distance, in instructions, to the first later instruction that reads one of
the registers it loads (or ``-`` when none reads them before they are written again or the
function ends), then lists the loads read within ``--near`` instructions with the instructions
between: a warp waits out such a load's whole latency at that reader (the wait ``ncu_stalls.py``
shows as a stall on the reader).  The scan follows program order, not branches, so a load
issued at a loop's end and read at its start shows the distance to the end's readers only.
``--json`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
"""An instruction line of ``cuobjdump -sass``: its address and text (without the encoding)."""
FUNCTION = re.compile(r"Function : (\S+)")
REGISTER = re.compile(r"\bR(\d+)(\.64|\.128)?\b")
WIDTHS = {"": 1, ".64": 2, ".128": 4}
"""Registers an ``LDG`` writes by its width suffix."""


@dataclass
class Load:
    """One ``LDG`` with a register destination: where, what, its registers, and its first reader
    (``distance`` instructions later, ``None`` when none; ``branch_between``: a branch or an
    mbarrier wait lies between the two)."""

    address: str
    text: str
    registers: list[int]
    distance: int | None
    reader: str | None
    branch_between: bool = False


def instructions(sass: str) -> dict[str, list[tuple[str, str]]]:
    """``{function: [(address, text), ...]}`` of a ``cuobjdump -sass`` listing, in order."""
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in sass.splitlines():
        name = FUNCTION.search(line)
        if name:
            current = out.setdefault(name.group(1), [])
        elif current is not None and (m := LINE.match(line)):
            current.append((m.group(1), m.group(2)))
    return out


def operands(text: str) -> tuple[str, list[str]]:
    """``(opcode, operands)`` of an instruction's text (its predicate guard dropped)."""
    text = re.sub(r"^@!?U?P\w+\s+", "", text)
    opcode, _, rest = text.partition(" ")
    return opcode, [o.strip() for o in rest.split(",")] if rest else []


def registers_of(operand: str) -> list[int]:
    """The general registers an operand names (``R4.64`` names R4 and R5; ``RZ`` none)."""
    out = []
    for m in REGISTER.finditer(operand):
        base = int(m.group(1))
        out += range(base, base + WIDTHS[m.group(2) or ""])
    return out


def load_width(opcode: str) -> int:
    """Registers an ``LDG`` opcode fills (``LDG.E.64``: 2, ``LDG.E.128``: 4, else 1)."""
    return 4 if ".128" in opcode else 2 if ".64" in opcode else 1


NO_DESTINATION = ("ST", "LDGSTS", "BRA", "EXIT", "BAR", "RED", "ARRIVES", "CALL", "RET", "SYNCS", "MEMBAR")
"""Opcode prefixes whose first operand is read, not written (stores, barriers, branches)."""


WAITS = ("BRA", "SYNCS.PHASECHK", "BAR.SYNC", "WARPSYNC", "EXIT")
"""Opcode prefixes that end a stretch of straight-line code (a branch) or wait (an mbarrier
phase check, a block barrier)."""


def written_and_read(text: str) -> tuple[set[int], set[int]]:
    """The general registers an instruction writes (its first operand's, except for the
    opcodes of :data:`NO_DESTINATION`) and those it reads (the rest)."""
    opcode, ops = operands(text)
    if not ops:
        return set(), set()
    if opcode.startswith(NO_DESTINATION):
        return set(), {r for o in ops for r in registers_of(o)}
    return set(registers_of(ops[0])), {r for o in ops[1:] for r in registers_of(o)}


def loads(code: list[tuple[str, str]]) -> list[Load]:
    """Each register-destination ``LDG`` of one function with its first reader in program order."""
    out = []
    for k, (address, text) in enumerate(code):
        opcode, ops = operands(text)
        if not opcode.startswith("LDG") or opcode.startswith("LDGSTS") or not ops:
            continue
        head = REGISTER.match(ops[0])
        if head is None:
            continue
        regs = set(range(int(head.group(1)), int(head.group(1)) + load_width(opcode)))
        distance = reader = None
        branch = False
        for j in range(k + 1, len(code)):
            written, read = written_and_read(code[j][1])
            if read & regs:
                distance, reader = j - k, code[j][1]
                break
            if written & regs:  # overwritten before any read
                break
            branch = branch or operands(code[j][1])[0].startswith(WAITS)
        out.append(Load(address, text, sorted(regs), distance, reader, branch))
    return out


def read_sass(path: Path) -> str:
    """A SASS listing: the file itself, or ``cuobjdump -sass`` of a cubin (``.cubin``)."""
    if path.suffix != ".cubin":
        return path.read_text()
    tool = shutil.which("cuobjdump")
    if tool is None:
        raise SystemExit(f"error: {path} is a cubin and cuobjdump is not on PATH (CUDA toolkit's bin)")
    done = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True)
    if done.returncode:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise SystemExit(f"error: cuobjdump -sass {path}: {why}")
    return done.stdout


def report(sass: str, near: int) -> dict:
    """``{function: {"instructions", "loads", "near", "code"}}``: every load, and the exposed
    ones: read within ``near`` instructions, with no branch or wait between."""
    out = {}
    for name, code in instructions(sass).items():
        found = loads(code)
        close = [
            ld for ld in found if ld.distance is not None and ld.distance <= near and not ld.branch_between
        ]
        out[name] = {"instructions": len(code), "loads": found, "near": close, "code": code}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sass", type=Path, help="cuobjdump -sass output, or a .cubin")
    p.add_argument(
        "--near",
        type=int,
        default=32,
        help="list loads read within this many instructions, no branch or wait between",
    )
    p.add_argument("--json", type=Path, help="also write the report as JSON")
    a = p.parse_args(argv)
    if not a.sass.exists():
        print(f"error: {a.sass} does not exist", file=sys.stderr)
        return 1
    result = report(read_sass(a.sass), a.near)
    if not result:
        print(f"error: {a.sass} holds no SASS function (expected cuobjdump -sass output)", file=sys.stderr)
        return 1
    for name, r in result.items():
        print(
            f"{name}: {r['instructions']} instructions, {len(r['loads'])} register loads, "
            f"{len(r['near'])} exposed (read within {a.near}, no branch or wait between)"
        )
        for ld in r["loads"]:
            across = " (across a branch or wait)" if ld.branch_between else ""
            print(f"  {ld.address}  {ld.text:<60} first read after {ld.distance or '-'}{across}")
        index = {address: k for k, (address, _) in enumerate(r["code"])}
        for ld in r["near"]:
            k = index[ld.address]
            print(f"  exposed, read after {ld.distance}: {ld.address}")
            for address, text in r["code"][k : k + ld.distance + 1]:
                print(f"    {address}  {text}")
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    n: {
                        "instructions": r["instructions"],
                        "loads": [asdict(x) for x in r["loads"]],
                        "near": a.near,
                    }
                    for n, r in result.items()
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
