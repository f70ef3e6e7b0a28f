"""The engine serving the built-in tiny DeepSeek-V4 model on the ``cuda_sm100`` op table, its
Triton kernels run in Triton's CPU interpreter, against the reference backend.

``TRITON_INTERPRET=1`` must be set before Triton is imported and must not leak into this pytest
process, so the engines run in a child: ``python test_interpreter_engine.py
--interpreter-report`` prints a JSON report.  With ``kv_cache_dtype="fp8"`` (packed FP8 window
rings and compressed pools, every store through the backend's ``cache_write`` kernel) and
prompts that span several chunks and close compressor windows, greedy decoding gives the
reference backend's tokens, and the packed pools were written by the kernel.  (Dense GEMMs on
the tiny model's plain weights stay cuBLAS's, i.e. the reference's, as on a GPU.)
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


def _plugin():
    """A plugin registering a CPU backend whose ops are ``cuda_sm100``'s (interpreted)."""
    from deepinfer_cuda_sm100.ops import load_ops

    from deepinfer_core.backends import BackendSpec
    from deepinfer_core.hookspecs import hookimpl

    class Interpreted:
        @hookimpl
        def deepinfer_register_backends(self, register):
            register(BackendSpec(BACKEND, "cpu", priority=1, ops=load_ops))

    return Interpreted()


def greedy_tokens(backend: str) -> list[list[int]]:
    """Greedy tokens of two prompts (30 and 47 ids) on the tiny model with the FP8 KV cache."""
    from deepinfer_core import SamplingParams
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.testing import manager_with_plugin

    plugins = manager_with_plugin(_plugin(), BACKEND) if backend == BACKEND else None
    config = EngineConfig(
        backend=backend, max_num_seqs=2, max_model_len=96, enforce_eager=True, kv_cache_dtype="fp8",
        max_num_batched_tokens=32,
    )  # fmt: skip
    engine = LLMEngine(config, plugins=plugins)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((30, 47)):
        engine.add_request(str(i), [rng.randrange(4, 400) for _ in range(n)], params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done["0"], done["1"]]


def interpreter_report() -> dict:
    """The engines' tokens and the FP8 pool writes the kernel made (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common, cache_write

    writes = [0]
    kernel_write = cache_write.write_fp8_rows

    def counted(*args, **kwargs):
        writes[0] += 1
        return kernel_write(*args, **kwargs)

    cache_write.write_fp8_rows = counted
    report = {"interpreted": _common.INTERPRETED, "reference": greedy_tokens("reference")}
    report["interpreted_tokens"] = greedy_tokens(BACKEND)
    report["fp8_writes"] = writes[0]
    return report


test_kernel_ran_interpreted = checks.test_kernel_ran_interpreted  # the report's shared test


@pytest.mark.slow  # two engines in a fresh interpreter, the kernels interpreted: ~40 s
def test_the_interpreted_op_table_decodes_the_reference_tokens_with_fp8_kv(report):
    assert report["fp8_writes"] > 0, "no FP8 pool was written by the cache_write kernel"
    assert report["interpreted_tokens"] == report["reference"]


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
