"""A third-party backend plugin, built from docs/writing-a-backend-plugin.md and pip-installed.

The package files are the code blocks of the doc itself (each block starting with a
``# path`` comment, plus the ``pyproject.toml`` block), so the doc cannot drift from what
works.  Every check runs in a fresh interpreter, where the new entry point is visible.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer_core.ops import all_ops, get_op

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "writing-a-backend-plugin.md"
DIST = "deepinfer-toy"

pytestmark = pytest.mark.slow  # pip-installs a package and runs each check in a fresh interpreter


def doc_files() -> dict[str, str]:
    """The package files of the doc: ``{relative path: text}``."""
    files: dict[str, str] = {}
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", DOC.read_text(), flags=re.S):
        first = body.splitlines()[0]
        if lang == "toml" and "[build-system]" in body:
            files["pyproject.toml"] = body
        elif lang == "python" and first.startswith("# ") and first.endswith(".py"):
            files[first[2:].strip()] = body
    return files


def run_python(code: str, **kwargs) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (entry points are read at start-up)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, **kwargs
    )


@pytest.fixture(scope="module")
def toy_package(tmp_path_factory) -> Path:
    """The doc's package, written to a temporary directory and pip-installed (removed afterwards)."""
    root = tmp_path_factory.mktemp("deepinfer-toy")
    files = doc_files()
    assert {"pyproject.toml", "deepinfer_toy/kernels.py", "deepinfer_toy/plugin.py"} <= set(files), files
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "deepinfer_toy" / "__init__.py").write_text('"""Toy DeepInfer backend."""\n')
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", str(root)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    hint = "building without isolation needs setuptools>=70 (or wheel) in this environment: the [test] extra"
    assert done.returncode == 0, f"{done.stderr}\n{hint}"
    yield root
    subprocess.run(
        [sys.executable, "-m", "pip", "uninstall", "-y", "-q", DIST], capture_output=True, timeout=300
    )


def test_plugins_report_lists_toy_backend_and_its_ops(toy_package):
    done = subprocess.run(
        [sys.executable, "-m", "deepinfer_core.cli", "plugins"], capture_output=True, text=True, timeout=300
    )
    report = {row["name"]: row for row in json.loads(done.stdout)}
    toy = report["toy"]
    assert toy["status"] == "loaded", toy["errors"]
    assert toy["dist"] == DIST and toy["version"] == "0.1.0" and toy["api_range"] == ">=1.0,<2"
    [backend] = toy["backends"]
    assert backend["name"] == "toy" and backend["available"] is True and backend["reason"] is None
    assert backend["ops"] == ["rms_norm"]
    assert report["core"]["status"] == "loaded"


def test_resolving_toy_uses_its_rms_norm_and_reference_for_the_rest(toy_package):
    done = run_python(
        """
        import json, logging, torch
        logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
        from deepinfer_core.backends import resolve_backend
        from deepinfer_core.ops import all_ops, get_op
        from deepinfer_toy import kernels
        spec, ops = resolve_backend("toy", strict_ops=False)
        x, w = torch.randn(3, 16), torch.rand(16) + 0.5
        y = ops.rms_norm(x, w, 1e-6)
        calls = kernels.CALLS
        # a fused op the plugin leaves out runs as its parts: the last one is the toy's rms_norm
        args, kw = get_op("hc_post_pre").sample_cases(torch.Generator().manual_seed(0), torch.float32)[0]
        fused = ops.hc_post_pre(*args, **kw)[-1]
        print(json.dumps({
            "plugin": spec.plugin,
            "calls": calls,
            "calls_by_fused": kernels.CALLS - calls,
            "fused_matches": torch.equal(fused, get_op("hc_post_pre").reference(*args, **kw)[-1]),
            "matches_reference": torch.equal(y, get_op("rms_norm").reference(x, w, 1e-6)),
            "linear_is_reference": ops.linear is get_op("linear").reference,
            "sources": ops.sources,
        }))
        """
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["plugin"] == "toy" and out["calls"] == 1 and out["matches_reference"]
    assert out["linear_is_reference"]
    assert out["sources"]["rms_norm"] == "backend+fallback"
    assert out["calls_by_fused"] == 1 and out["fused_matches"]
    fused = {name for name, op in all_ops().items() if op.decomposition is not None}
    assert {"hc_post_pre", "compress_windows", "qk_norm_rope"} <= fused
    assert {out["sources"][name] for name in fused} == {"decomposed"}
    assert {src for name, src in out["sources"].items() if name not in fused | {"rms_norm"}} == {"reference"}
    warning = [line for line in done.stderr.splitlines() if line.startswith("deepinfer.ops WARNING")]
    assert len(warning) == 1, done.stderr
    assert "'toy'" in warning[0] and "'linear'" in warning[0] and "'rms_norm'" not in warning[0]
    assert "'hc_post_pre'" not in warning[0]  # not missing: it runs as its parts


def test_strict_ops_refuses_toy_backend_missing_ops(toy_package):
    done = run_python(
        """
        from deepinfer_core.backends import resolve_backend
        from deepinfer_core.errors import OpNotSupportedError
        try:
            resolve_backend("toy", strict_ops=True)
        except OpNotSupportedError as exc:
            print("refused:", exc)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused:") and "'toy'" in done.stdout and "strict_ops" in done.stdout


def test_toy_package_conformance_tests_pass(toy_package):
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(toy_package / "tests")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=toy_package,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # rms_norm's cases, and those of the fused ops it leaves to their decomposition (run on its
    # rms_norm), each in float32 and bfloat16
    ops = ["rms_norm"] + [name for name, op in all_ops().items() if op.decomposition is not None]
    dtypes = (torch.float32, torch.bfloat16)
    count = sum(len(get_op(op).sample_cases(torch.Generator(), dt)) for op in ops for dt in dtypes)
    assert f"{count} passed" in done.stdout, done.stdout


def test_engine_configured_with_toy_backend_calls_its_kernel(toy_package, tmp_path):
    model_dir = tmp_path / "tiny"
    made = subprocess.run(
        [sys.executable, "-m", "deepinfer_core.cli", "make-tiny", str(model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    done = run_python(
        f"""
        from deepinfer_core import LLM, SamplingParams
        from deepinfer_toy import kernels
        llm = LLM(model={str(model_dir)!r}, backend="toy")
        llm.generate(["hello"], SamplingParams(max_tokens=2))
        print(kernels.CALLS)
        """
    )
    assert done.returncode == 0, done.stderr
    calls = int(done.stdout.split()[-1])
    assert calls > 0, "the engine never called the toy backend's rms_norm"
