"""A backend's packed KV format substitute (``BackendSpec.kv_formats``) end to end: a backend of
the reference ops declaring ``{"fp8": "fp8_tile128"}`` serves the tiny model with
``kv_cache_dtype="fp8"`` from per-tile FP8 pools, bitwise like a plain-cache engine whose
attention reads every key through that format."""

from __future__ import annotations

import torch

from deepinfer_core import SamplingParams
from deepinfer_core.backends import BackendSpec
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.models.cache_spec import RingSpec
from deepinfer_core.ops.kv_format import Fp8KVPool
from deepinfer_core.ops.kv_tile import TileFp8KVPool, dequantize_tile_rows, quantize_tile_rows, tile_row_bytes
from deepinfer_core.testing import manager_with_plugin


class _TileBackend:
    """``tile_kv``: the reference ops, the ``fp8`` caches stored as ``fp8_tile128``."""

    @hookimpl
    def deepinfer_register_backends(self, register):
        register(BackendSpec("tile_kv", "cpu", priority=1, kv_formats={"fp8": "fp8_tile128"}))


def _engine(backend: str, **kw) -> LLMEngine:
    plugins = manager_with_plugin(_TileBackend(), "tile_kv") if backend == "tile_kv" else None
    config = EngineConfig(backend=backend, max_num_seqs=8, max_num_batched_tokens=16, **kw)
    return LLMEngine(config, plugins=plugins)


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple]:
    """Greedy tokens and their logprobs per prompt (prompts span several chunks)."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = (list(o.outputs[0].token_ids), o.outputs[0].logprobs)
    return [done[str(i)] for i in range(len(prompts))]


def test_substituted_cache_equals_a_plain_cache_read_through_the_tile_format():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (3, 11, 40, 70)]
    tiled = _engine("tile_kv", kv_cache_dtype="fp8")
    runner = tiled.runner
    ring_spec = next(s for s in runner.cache_specs[0] if isinstance(s, RingSpec))
    assert ring_spec.kv_format == "fp8_tile128"
    assert isinstance(runner.cache.get(0, "window"), TileFp8KVPool)
    assert runner.config.slot_bytes >= ring_spec.rows * tile_row_bytes(ring_spec.dim)
    got = _generate(tiled, prompts)
    assert got != _generate(_engine("reference"), prompts)  # the quantisation shows in the logprobs

    ref = _engine("reference")
    ops = ref.runner.ops
    inner = ops.sparse_attention

    def attention(q, pools, indices, sinks, scale):
        quantised = [dequantize_tile_rows(quantize_tile_rows(p), p.shape[-1], q.dtype) for p in pools]
        return inner(q, quantised, indices, sinks, scale)

    ops.sparse_attention = attention
    assert got == _generate(ref, prompts)
    # the reference backend itself keeps the model's format
    assert isinstance(_engine("reference", kv_cache_dtype="fp8").runner.cache.get(0, "window"), Fp8KVPool)
