"""Every install hint works from a checkout: each ``pip install ...`` the code prints (error
messages, availability reasons, skip reasons, docstrings) and each one in the user docs names
either a directory of this repository with extras its ``pyproject.toml`` declares, or a
third-party requirement the project itself declares (same pin).  None names a DeepInfer
distribution as an index requirement: those are on no package index.

``scripts/setup.sh --print-installs`` is checked the same way, and its runtime set-up must
install the requirement of the ``llguidance`` structured-output backend.

A hint's command runs from ``pip install`` to the end of its line or string, or to the first
``,`` ``;`` ``)`` ``(`` or backquote outside quotes and brackets: write a hint as
``... pip install X, or ... pip install -e 'plugins/p[extra]'``, on one line of a doc.
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("deepinfer_core", "plugins", "tests", "benchmarks", "scripts")
# the repository's projects: {directory relative to the root ("." for the core): pyproject.toml}
PROJECTS = {
    p.parent.relative_to(ROOT).as_posix(): p
    for p in [ROOT / "pyproject.toml", *ROOT.glob("plugins/*/pyproject.toml")]
}
# pip options that take a value; -e takes the path of a project
_VALUE_OPTIONS = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url"}
_EDITABLE = {"-e", "--editable"}


def _project(rel: str) -> dict:
    return tomllib.loads(PROJECTS[rel].read_text())["project"]


DEEPINFER_DISTS = {canonicalize_name(_project(rel)["name"]) for rel in PROJECTS}


def declared_requirements() -> list[Requirement]:
    """Every third-party requirement of the repository's pyprojects (dependencies and extras)."""
    out = []
    for rel in PROJECTS:
        project = _project(rel)
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs += extra
        out += [r for r in map(Requirement, reqs) if canonicalize_name(r.name) not in DEEPINFER_DISTS]
    return out


def extra_requirements(rel: str, extra: str) -> list[Requirement]:
    """The requirements of ``rel``'s extra ``extra``, its references to its own extras expanded."""
    project = _project(rel)
    out = []
    for req in map(Requirement, project["optional-dependencies"][extra]):
        if canonicalize_name(req.name) == canonicalize_name(project["name"]):
            for inner in sorted(req.extras):
                out += extra_requirements(rel, inner)
        else:
            out.append(req)
    return out


def hint_commands(text: str) -> Iterator[list[str]]:
    """The argument lists of the ``pip install`` commands in ``text`` (see the module docstring)."""
    for match in re.finditer(r"pip install(?!\w)", text):
        chars, quote, depth = [], None, 0
        for ch in text[match.end() :]:
            if quote:
                quote = None if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "[":
                depth += 1
            elif ch == "]":
                depth -= 1
            elif depth == 0 and ch in ",;()`\n":
                break
            chars.append(ch)
        yield shlex.split("".join(chars), comments=True)


def problems(args: list[str], *, own_paths_only: bool = False) -> list[str]:
    """What is wrong with ``pip install <args>`` (empty when it installs from a checkout).

    ``own_paths_only``: an editable target outside ``.`` and ``plugins/`` is the reader's own
    package (a tutorial's), not checked.
    """
    found: list[str] = []
    declared = declared_requirements()
    it = iter(args)
    targets = []
    for arg in it:
        if arg in _EDITABLE:
            targets.append(("path", next(it, "")))
        elif arg in _VALUE_OPTIONS:
            next(it, None)
        elif arg.startswith("-"):
            continue
        elif arg.startswith((".", "/")) or "/" in arg:
            targets.append(("path", arg))
        else:
            targets.append(("requirement", arg))
    if not targets:
        found.append(f"installs nothing: pip install {' '.join(args)}")
    for kind, spec in targets:
        if kind == "path":
            path, _, extras = spec.partition("[")
            rel = Path(path).as_posix().rstrip("/") or "."
            if own_paths_only and not (rel == "." or rel.startswith("plugins/")):
                continue
            if rel not in PROJECTS:
                found.append(f"{spec!r}: no pyproject.toml at {rel!r} of the repository")
                continue
            have = set(_project(rel).get("optional-dependencies", {}))
            for extra in filter(None, extras.rstrip("]").split(",")):
                if extra.strip() not in have:
                    found.append(f"{spec!r}: {rel}/pyproject.toml has no extra {extra!r} ({sorted(have)})")
        else:
            try:
                req = Requirement(spec)
            except InvalidRequirement as e:
                found.append(f"{spec!r} is not a requirement: {e}")
                continue
            name = canonicalize_name(req.name)
            if name in DEEPINFER_DISTS:
                found.append(f"{spec!r} is a DeepInfer distribution, on no index: use -e <its directory>")
                continue
            same = [d for d in declared if canonicalize_name(d.name) == name]
            if not same:
                found.append(f"{spec!r}: no pyproject of the repository declares {req.name!r}")
            elif req.specifier and all(str(d.specifier) != str(req.specifier) for d in same):
                found.append(f"{spec!r}: the project declares {[str(d) for d in same]}")
    return found


def code_strings() -> Iterator[tuple[str, int, str]]:
    """``(file, line, text)`` of every string literal of the repository's Python files (an
    f-string's literal parts joined around ``{}``), this file's own examples excepted."""
    me = Path(__file__).resolve()
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if path == me or any(part.startswith(".") or part == "build" for part in rel.parts):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.JoinedStr):
                    text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    text = node.value
                else:
                    continue
                if "pip install" in text:
                    yield str(rel), node.lineno, text


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md")), *sorted(ROOT.glob("plugins/*/README.md"))]


def test_the_checker_refuses_what_does_not_install_from_a_checkout():
    assert problems(["deepinfer-samplers[structured]"])  # on no index
    assert problems(["-e", "plugins/samplers[nope]"])  # no such extra
    assert problems(["-e", "plugins/nope"])  # no such directory
    assert problems(["llguidance==0.0.1"])  # not the project's pin
    assert problems(["no-such-package"])  # not a requirement of the project
    assert problems(["--no-deps"])  # installs nothing
    ok = ["-e", ".[hub]", "-e", "plugins/samplers[structured,xgrammar]", "llguidance==1.9.1", "torch_npu"]
    assert problems(ok) == []
    assert list(hint_commands("x: pip install a==1, or pip install -e 'p[b,c]') z")) == [
        ["a==1"],
        ["-e", "p[b,c]"],
    ]


def test_every_install_hint_in_the_code_installs_from_a_checkout():
    seen, bad = set(), []
    for rel, line, text in code_strings():
        for args in hint_commands(text):
            seen.add(rel)
            bad += [f"{rel}:{line}: {p}" for p in problems(args)]
    assert not bad, "\n".join(bad)
    # the probes that print hints at run time are among the files checked
    assert {
        "plugins/samplers/deepinfer_samplers/plugin.py",
        "plugins/cuda_sm100/deepinfer_cuda_sm100/backend.py",
        "plugins/ascend950/deepinfer_ascend950/backend.py",
        "deepinfer_core/engine/structured.py",
        "deepinfer_core/hub.py",
    } <= seen, sorted(seen)


def test_every_install_hint_in_the_docs_installs_from_a_checkout():
    bad, count = [], 0
    for path in doc_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for args in hint_commands(line):
                count += 1
                bad += [f"{path.relative_to(ROOT)}:{n}: {p}" for p in problems(args, own_paths_only=True)]
    assert not bad, "\n".join(bad)
    assert count >= 5


def _setup_installs(*flags: str) -> list[str]:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh"), *flags, "--print-installs"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_setup_installs_the_structured_outputs_backend():
    llguidance = [r for r in extra_requirements("plugins/samplers", "structured") if r.name == "llguidance"]
    assert llguidance, "the samplers plugin's [structured] extra lost llguidance"
    for flags in ((), ("--test",)):
        args = _setup_installs(*flags)
        assert problems(args) == [], args
        samplers = [a for a in args if a.partition("[")[0] == "plugins/samplers"]
        assert len(samplers) == 1, args
        extras = samplers[0].partition("[")[2].rstrip("]").split(",")
        reqs = [
            str(r) for extra in filter(None, extras) for r in extra_requirements("plugins/samplers", extra)
        ]
        assert str(llguidance[0]) in reqs, (flags, samplers)
