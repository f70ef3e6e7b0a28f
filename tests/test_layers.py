"""Imports of ``deepinfer_core`` run one way: a layer never imports one above it.

Pure AST, no import of the package.  Every ``import`` of a ``deepinfer_core`` module counts —
module-level, inside a function (lazy) and under ``if TYPE_CHECKING`` — and importing
``a.b.c`` also runs the ``__init__`` of the packages ``a.b`` and ``a`` on the way, so those
count as imported too (the package root excepted: it imports nothing at run time, checked
below).  Three rules:

1. no import of a module in a higher layer than the importer's (:data:`LAYERS`, lowest first);
2. no import cycle at all, inside a layer included, whatever kind of import closes it;
3. a function-level import of a ``deepinfer_core`` module is there for a stated reason
   (:data:`LAZY`, :data:`LAZY_MODULES`), never to dodge a cycle: the layering makes those
   top-level imports.

Exceptions are listed in :data:`EXCEPTIONS`, each with its reason.  Imports of third-party
packages (transformers, triton, huggingface_hub, ...) are not this test's business.
See docs/architecture.md, "Layers".
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "deepinfer_core"

# Lowest first.  A pattern is a module name, or a package name followed by ".*" (the package's
# ``__init__`` and everything under it).  The first matching layer wins; every module must match.
LAYERS: list[tuple[str, list[str]]] = [
    (
        "foundation",
        [
            "deepinfer_core.errors",
            "deepinfer_core.logging_utils",
            "deepinfer_core.outputs",
            "deepinfer_core.devices",
            "deepinfer_core.hookspecs",
            "deepinfer_core.hub",
            "deepinfer_core.tokenizer",
            "deepinfer_core.user_files",
        ],
    ),
    ("weights", ["deepinfer_core.weights.*"]),
    ("ops", ["deepinfer_core.ops.*"]),
    ("contract", ["deepinfer_core.contract.*"]),
    ("config", ["deepinfer_core.config", "deepinfer_core.config_sections", "deepinfer_core.config_sources"]),
    ("backends", ["deepinfer_core.backends.*", "deepinfer_core.plugins.*"]),
    (
        "models",
        [
            "deepinfer_core.models",
            "deepinfer_core.models.registry",
            "deepinfer_core.models.cache_spec",
            "deepinfer_core.models.config_utils",
            "deepinfer_core.models.context_parallel",
            "deepinfer_core.models.weight_bytes",
        ],
    ),
    ("deepseek_v4", ["deepinfer_core.models.deepseek_v4.*"]),
    ("deepseek_v41", ["deepinfer_core.models.deepseek_v41.*"]),
    ("sampling", ["deepinfer_core.sampling.*"]),
    ("speculative", ["deepinfer_core.speculative.*"]),
    (
        "parallel",
        [
            "deepinfer_core.distributed",
            "deepinfer_core.distributed.init",
            "deepinfer_core.distributed.eplb.*",
            "deepinfer_core.distributed.cost_model",
            "deepinfer_core.distributed.gpu_specs",
        ],
    ),
    ("engine", ["deepinfer_core.engine.*"]),
    (
        "drivers",
        [
            "deepinfer_core.distributed.protocol",
            "deepinfer_core.distributed.faults",
            "deepinfer_core.distributed.metrics",
            "deepinfer_core.distributed.processes",
            "deepinfer_core.distributed.serve",
            "deepinfer_core.distributed.diagnosis",
            "deepinfer_core.distributed.coordinator",
            "deepinfer_core.distributed.worker",
        ],
    ),
    ("openai", ["deepinfer_core.openai.*"]),
    (
        "api",
        [
            "deepinfer_core",
            "deepinfer_core.batch.*",
            "deepinfer_core.serve.*",
            "deepinfer_core.llm",
            "deepinfer_core.bench",
            "deepinfer_core.benchmarking.*",
            "deepinfer_core.cli",
            "deepinfer_core.cli_engine_args",
            "deepinfer_core.cli_generate",
            "deepinfer_core.cli_status",
            "deepinfer_core.launch",
            "deepinfer_core.builtin_plugin",
            "deepinfer_core.testing.*",
        ],
    ),
]

# (importer, imported): why this edge may break the rules.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("deepinfer_core.ops.registry", "deepinfer_core.ops._load_all"): (
        "the registry imports every op family module on first lookup so that all ops are "
        "registered; the op modules themselves register through the registry (import-time "
        "registration, a deliberate cycle inside the ops layer)"
    ),
    ("deepinfer_core.plugins.manager", "deepinfer_core.builtin_plugin"): (
        "the plugin manager loads the core's own plugin like any plugin (its entry point), "
        "importing it by name only when running from a source tree without the entry point; "
        "the builtin plugin is the composition root that names every layer's registrations"
    ),
    ("deepinfer_core.engine.speculative", "deepinfer_core.engine.llm_engine"): (
        "type-only back reference: the SpeculativeDecoder is a part of the LLMEngine that "
        "builds it and is handed that engine"
    ),
}

# Function-level imports of deepinfer_core modules kept lazy on purpose, by importer module.
LAZY_MODULES: dict[str, str] = {
    "deepinfer_core.cli": "a command imports only what it runs (`deepinfer --help` does not load torch)",
    "deepinfer_core.cli_generate": "`deepinfer generate` loads the engine only when it runs, not for --help",
    "deepinfer_core.launch": "torchrun entry: rank 0 runs the CLI, the others the worker loop",
    "deepinfer_core.bench": "`deepinfer bench` loads the engine only once its arguments are valid",
    "deepinfer_core.serve.server": "fastapi and uvicorn (the [serve] extra) load only once they are checked",
    "deepinfer_core.benchmarking.harness": "the version is read when a report is written, not on import",
    "deepinfer_core.builtin_plugin": (
        "registrations are lazy factories: registering a component does not import it"
    ),
}

# (importer, imported): function-level imports kept lazy on purpose.
LAZY: dict[tuple[str, str], str] = {
    ("deepinfer_core.ops.registry", "deepinfer_core.ops._load_all"): "see EXCEPTIONS",
    ("deepinfer_core.plugins.manager", "deepinfer_core.builtin_plugin"): "see EXCEPTIONS",
    **{
        ("deepinfer_core.llm", m): "a single-process LLM never loads the distributed runtime"
        for m in (
            "deepinfer_core.distributed",
            "deepinfer_core.distributed.init",
            "deepinfer_core.distributed.coordinator",
            "deepinfer_core.distributed.worker",
        )
    },
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    kind: str  # "module", "function" or "type"
    line: int


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / PKG).rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()
PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def _target(name: str) -> str | None:
    """The longest prefix of ``name`` that is a module of the package (``from a import b``:
    ``a.b`` when it is a module, else ``a``)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_of(module: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found: list[Import] = []

    def names(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if node.level:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            source = ".".join([*base, *([node.module] if node.module else [])])
        else:
            source = node.module or ""
        return [f"{source}.{a.name}" for a in node.names]

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, "type")
                for stmt in child.orelse:
                    visit_stmt(stmt, kind)
                continue
            visit_stmt(child, kind)

    def visit_stmt(node: ast.AST, kind: str) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in names(node):
                target = _target(name) if name.split(".")[0] == PKG else None
                if target is not None and target != module:
                    found.append(Import(module, target, kind, node.lineno))
        inner = kind
        if kind == "module" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner = "function"
        visit(node, inner)

    visit(tree, "module")
    return found


def _with_packages(imp: Import) -> list[Import]:
    """``imp`` and the package ``__init__``s importing its target runs (not the root's, nor
    the importer's own packages, which are already being imported)."""
    out = [imp]
    parts = imp.imported.split(".")
    for i in range(2, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg in PACKAGES and not (imp.importer + ".").startswith(pkg + "."):
            out.append(Import(imp.importer, pkg, imp.kind, imp.line))
    return out


def all_imports() -> list[Import]:
    out: list[Import] = []
    for module, path in sorted(MODULES.items()):
        for imp in _imports_of(module, path):
            out.extend(_with_packages(imp))
    return out


def layer_of(module: str) -> int | None:
    for rank, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if pattern.endswith(".*"):
                base = pattern[:-2]
                if module == base or module.startswith(base + "."):
                    return rank
            elif module == pattern:
                return rank
    return None


def _where(imp: Import) -> str:
    return f"{MODULES[imp.importer].relative_to(ROOT)}:{imp.line}"


def violations(imports: list[Import]) -> list[str]:
    out = []
    for imp in imports:
        if (imp.importer, imp.imported) in EXCEPTIONS:
            continue
        a, b = layer_of(imp.importer), layer_of(imp.imported)
        if a is not None and b is not None and b > a:
            out.append(
                f"{_where(imp)}: {imp.importer} ({LAYERS[a][0]}) imports {imp.imported} "
                f"({LAYERS[b][0]}, a higher layer; {imp.kind}-level)"
            )
    return sorted(set(out))


def cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        if (imp.importer, imp.imported) not in EXCEPTIONS:
            graph[imp.importer].add(imp.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(MODULES):
        if v not in index:
            strong(v)
    return out


def unjustified_lazy(imports: list[Import]) -> list[str]:
    return sorted(
        {
            f"{_where(imp)}: {imp.importer} imports {imp.imported} inside a function"
            for imp in imports
            if imp.kind == "function"
            and imp.importer not in LAZY_MODULES
            and (imp.importer, imp.imported) not in LAZY
            and layer_of(imp.imported) is not None
        }
    )


IMPORTS = all_imports()


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if layer_of(m) is None)
    assert not missing, f"add these modules to a layer of tests/test_layers.py (and the docs): {missing}"


def test_no_layer_imports_one_above_it():
    found = violations(IMPORTS)
    assert not found, "imports against the layer order (lowest first: {}):\n{}".format(
        " < ".join(name for name, _ in LAYERS), "\n".join(found)
    )


def test_no_import_cycles():
    found = cycles(IMPORTS)
    assert not found, "import cycles (module, function or TYPE_CHECKING imports):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_function_level_imports_are_justified():
    found = unjustified_lazy(IMPORTS)
    assert not found, (
        "function-level imports of deepinfer_core modules: make them top-level imports "
        "(the layering allows it) or state why they are lazy in tests/test_layers.py:\n" + "\n".join(found)
    )


def test_package_root_imports_nothing_at_run_time():
    """``import deepinfer_core`` stays cheap and cannot close a cycle: its names load lazily."""
    eager = [i for i in IMPORTS if i.importer == PKG and i.kind != "type"]
    assert not eager, [f"{_where(i)}: {i.imported}" for i in eager]


def test_exceptions_are_still_needed():
    """A listed exception or lazy import that no longer exists is removed from the lists."""
    edges = {(i.importer, i.imported) for i in IMPORTS}
    lazy = {(i.importer, i.imported) for i in IMPORTS if i.kind == "function"}
    stale = [e for e in EXCEPTIONS if e not in edges] + [e for e in LAZY if e not in lazy]
    stale += [m for m in LAZY_MODULES if not any(i.importer == m and i.kind == "function" for i in IMPORTS)]
    assert not stale, f"remove from tests/test_layers.py: {stale}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from deepinfer_core.contract.batch import SeqChunk", [("deepinfer_core.contract.batch", "module")]),
        ("def f():\n    import deepinfer_core.llm", [("deepinfer_core.llm", "function")]),
        ("if TYPE_CHECKING:\n    from deepinfer_core import llm", [("deepinfer_core.llm", "type")]),
        ("from .request import Request", [("deepinfer_core.engine.request", "module")]),
        ("from .. import config", [("deepinfer_core.config", "module")]),
        ("import torch", []),
    ],
)
def test_the_scan_sees_every_kind_of_import(tmp_path, source, expected):
    """The checker itself: each spelling of an import is found with its kind."""
    path = tmp_path / "mod.py"
    path.write_text(source + "\n")
    found = [(i.imported, i.kind) for i in _imports_of("deepinfer_core.engine.x", path)]
    assert found == expected


def test_a_package_import_runs_its_init():
    imp = Import("deepinfer_core.ops.moe", "deepinfer_core.weights.quant", "module", 1)
    assert [i.imported for i in _with_packages(imp)] == [
        "deepinfer_core.weights.quant",
        "deepinfer_core.weights",
    ]


def test_an_upward_import_is_reported():
    imp = Import("deepinfer_core.models.registry", "deepinfer_core.engine.request", "type", 1)
    assert violations([imp]) and "higher layer" in violations([imp])[0]
    cyc = [Import("deepinfer_core.llm", "deepinfer_core.cli", "function", 1)]
    cyc.append(Import("deepinfer_core.cli", "deepinfer_core.llm", "module", 1))
    assert cycles(cyc) == [["deepinfer_core.cli", "deepinfer_core.llm"]]
