"""The engine serving the built-in tiny DeepSeek-V4 model and a tiny DeepSeek-V4.1 on the
``cuda_sm100`` op table, its Triton kernels run in Triton's CPU interpreter, against the
reference backend.

``TRITON_INTERPRET=1`` must be set before Triton is imported and must not leak into this pytest
process, so the engines run in a child: ``python test_interpreter_engine.py
--interpreter-report`` prints a JSON report.  With the plain KV cache and with
``kv_cache_dtype="fp8"`` (packed FP8 window rings and compressed pools, every store through the
backend's ``cache_write`` kernel) and prompts that span several chunks and close compressor
windows, greedy decoding gives the reference backend's tokens, and the FP8 pools were written by
the ``cache_write`` kernel; on the
tiny V4.1 a backend whose only own op is ``cache_write`` (its block-scaled window records,
compressed entries and indexer keys) gives the reference's tokens and logprobs bit for bit.
(Dense GEMMs on the tiny model's plain weights stay cuBLAS's, i.e. the reference's, as on a
GPU.)
"""

from __future__ import annotations

import json
import os
import random
import sys

import cuda_sm100_checks as checks
import pytest

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

BACKEND = "cuda_sm100_interpreter"
"""Every op of the ``cuda_sm100`` table (interpreted)."""
CACHE_BACKEND = "cuda_sm100_cache_write"
"""The reference ops but ``cuda_sm100``'s ``cache_write`` (interpreted): every other op the
reference's, so the outputs must be the reference's bit for bit."""


def _plugin(name: str):
    """A plugin registering the CPU backend ``name`` (:data:`BACKEND` or :data:`CACHE_BACKEND`)."""
    from deepinfer_cuda_sm100.cache_ops import cache_ops
    from deepinfer_cuda_sm100.ops import load_ops

    from deepinfer_core.backends import BackendSpec
    from deepinfer_core.hookspecs import hookimpl

    ops = load_ops if name == BACKEND else cache_ops

    class Interpreted:
        @hookimpl
        def deepinfer_register_backends(self, register):
            register(BackendSpec(name, "cpu", priority=1, ops=ops))

    return Interpreted()


def greedy(backend: str, model: str | None = None, kv: str = "fp8") -> list[dict]:
    """Greedy tokens and their logprobs (the top 2 per position) of two prompts (30 and 47 ids)
    on a tiny model (default: the built-in V4) with the KV cache ``kv``."""
    from deepinfer_core import SamplingParams
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.testing import manager_with_plugin

    plugins = manager_with_plugin(_plugin(backend), backend) if backend != "reference" else None
    config = EngineConfig(
        backend=backend, max_num_seqs=2, max_model_len=96, enforce_eager=True, kv_cache_dtype=kv,
        max_num_batched_tokens=32, **({"model": model} if model else {}),
    )  # fmt: skip
    engine = LLMEngine(config, plugins=plugins)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    for i, n in enumerate((30, 47)):
        engine.add_request(str(i), [rng.randrange(4, 400) for _ in range(n)], params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                lps = [{str(t): float(lp) for t, lp in pos.items()} for pos in c.logprobs]
                done[out.request_id] = {"tokens": list(c.token_ids), "logprobs": lps}
    return [done["0"], done["1"]]


def interpreter_report() -> dict:
    """The engines' tokens and the FP8 pool writes the kernel made (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import tempfile
    from pathlib import Path

    from deepinfer_cuda_sm100.kernels import _common, cache_write, cache_write_blocks

    from deepinfer_core.models.deepseek_v41.tiny import make_tiny

    writes = {"fp8": 0, "blocks": 0}

    def counted(module, name, key):
        kernel = getattr(module, name)

        def write(*args, **kwargs):
            writes[key] += 1
            return kernel(*args, **kwargs)

        setattr(module, name, write)

    counted(cache_write, "write_fp8_rows", "fp8")
    counted(cache_write_blocks, "write_block_rows", "blocks")
    report = {"interpreted": _common.INTERPRETED, "reference": greedy("reference")}
    report["interpreted_tokens"] = [r["tokens"] for r in greedy(BACKEND)]
    report["plain_reference"] = [r["tokens"] for r in greedy("reference", kv="auto")]
    report["plain_interpreted"] = [r["tokens"] for r in greedy(BACKEND, kv="auto")]
    with tempfile.TemporaryDirectory() as tmp:
        v41 = str(make_tiny(Path(tmp) / "v41"))
        report["v41_reference"] = greedy("reference", v41)
        report["v41_cache_write"] = greedy(CACHE_BACKEND, v41)
    report["writes"] = writes
    return report


test_kernel_ran_interpreted = checks.test_kernel_ran_interpreted  # the report's shared test


@pytest.mark.slow  # engines in a fresh interpreter, the kernels interpreted: ~80 s
def test_the_interpreted_op_table_decodes_the_reference_tokens_with_fp8_kv(report):
    assert report["writes"]["fp8"] > 0, "no FP8 pool was written by the cache_write kernel"
    assert report["interpreted_tokens"] == [r["tokens"] for r in report["reference"]]


@pytest.mark.slow
def test_the_interpreted_op_table_decodes_the_reference_tokens_with_plain_kv(report):
    assert report["plain_interpreted"] == report["plain_reference"]


@pytest.mark.slow
def test_deepseek_v41_block_scaled_cache_writes_leave_the_reference_outputs_bitwise(report):
    """Only ``cache_write`` is the backend's: V4.1's tokens and logprobs are the reference's bit
    for bit (the other kernels' rounding differences flip the random tiny V4.1's indexer picks,
    whose scores tie at zero, so the whole table is compared on V4 above)."""
    assert report["writes"]["blocks"] > 0, "no block-scaled pool was written by the cache_write kernel"
    assert report["v41_cache_write"] == report["v41_reference"]


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
