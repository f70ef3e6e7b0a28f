"""DeepSeek-V4.1 with ``kv_cache_dtype="fp8"``: the window, compressed entries and indexer keys
live in the release's packed byte formats, the cache holds more tokens in the same memory, and
every result is bit for bit the ``kv_cache_dtype="auto"`` run's (which stores the same
``kv_qdq`` values in the model dtype) -- through chunked prefill, continuous batching, a
prefix-cache hit, preemption and speculative rollback; widths that are not whole blocks keep
the plain format."""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer_core.config import EngineConfig, SpeculativeConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.models.cache_spec import PagedSpec, RingSpec, SlotStateSpec, spec_bytes
from deepinfer_core.ops.kv_blockscaled import BlockScaledKVPool, block_row_bytes
from deepinfer_core.sampling.params import SamplingParams
from tests.engine.test_preemption_property import _run
from tests.models.v41.conftest import prefix_hit_and_cold_run, v41_llm, v41_plugins
from tests.models.v41.test_v41_model import _ids, _prompt_logits, _runner

FORMATS = {"window": "fp8_ue8m0", "ckv": "fp4_e4m3", "ikv": "fp4_ue8m0"}


def _same(got, want) -> None:
    """The same completions, tokens and logprobs bit for bit."""
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


def _per_page_and_slot(runner) -> tuple[int, int]:
    page = slot = 0
    for layer in runner.model.cache_specs(runner.kv_cache_dtype):
        for spec in layer:
            p, s = spec_bytes(spec, runner.page_size, runner.dtype)
            page, slot = page + p, slot + s
    return page, slot


def test_the_caches_are_packed_in_the_release_formats_and_hold_more_tokens(v41_dir):
    runner = _runner(v41_dir, kv_cache_dtype="fp8")
    cfg, cache = runner.model_config, runner.cache
    specs = runner.model.cache_specs("fp8")
    for layer, layer_specs in enumerate(specs):
        for spec in layer_specs:
            store = cache.get(layer, spec.name)
            if isinstance(spec, RingSpec | PagedSpec):
                assert spec.kv_format == FORMATS[spec.name]
                assert isinstance(store, BlockScaledKVPool) and store.fmt == FORMATS[spec.name]
                assert store.data.shape[1] == block_row_bytes(spec.kv_format, spec.dim)
            else:  # the compressor's partial windows and the Engram ids keep their dtype
                assert isinstance(spec, SlotStateSpec) and isinstance(store, torch.Tensor)
    # tiny widths (head 32, indexer 32): 33-byte window rows, 18-byte entries, 17-byte keys
    assert (cfg.head_dim, cfg.index_head_dim) == (32, 32)
    assert cache.get(0, "window").data.shape[1] == 33
    assert cache.get(2, "ckv").data.shape[1] == 18 and cache.get(2, "ikv").data.shape[1] == 17
    assert cache.get(3, "ckv") is cache.get(2, "ckv")  # alias_of: the group's one pool
    # per page of 16 tokens: 8 + 8 + 16 entries of the three kv sources, an entry and a key each
    page, slot = _per_page_and_slot(runner)
    assert page == (8 + 8 + 16) * (18 + 17)
    plain = _runner(v41_dir)
    plain_page, plain_slot = _per_page_and_slot(plain)
    assert plain_page == (8 + 8 + 16) * 2 * 32 * 4 and page * 7 < plain_page and slot < plain_slot
    assert cache.nbytes < plain.cache.nbytes / 2
    # the same memory holds more tokens
    small = {"kv_cache_memory_gb": 0.0001}
    packed_cap = v41_llm(v41_dir, kv_cache_dtype="fp8", **small).kv_cache_capacity_tokens
    assert packed_cap > 7 * v41_llm(v41_dir, **small).kv_cache_capacity_tokens


@pytest.mark.slow
@pytest.mark.parametrize("invariant", [False, True])
def test_fp8_cache_generates_the_auto_cache_tokens_and_logprobs_bitwise(v41_dir, invariant):
    """Chunked prefill (16-token budget), continuous batching, entries read by Reuse / Reindex
    layers and both top-k levels: packed pools give the plain cache's results bit for bit."""
    prompts = [{"prompt_token_ids": _ids(30 + i, n)} for i, n in enumerate((5, 33, 70, 101))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    kw = {"batch_invariant": invariant, "max_num_seqs": 3, "max_num_batched_tokens": 16}
    got = v41_llm(v41_dir, kv_cache_dtype="fp8", **kw).generate(prompts, params, use_tqdm=False)
    want = v41_llm(v41_dir, **kw).generate(prompts, params, use_tqdm=False)
    _same(got, want)


@pytest.mark.slow
def test_chunked_prefill_logits_equal_the_auto_cache_and_the_unchunked_pass(v41_dir):
    ids = _ids(4, 50)
    fp8 = _runner(v41_dir, batch_invariant=True, kv_cache_dtype="fp8")
    chunked = _prompt_logits(fp8, ids, 7)
    assert torch.equal(chunked, _prompt_logits(_runner(v41_dir, batch_invariant=True), ids, 7))
    assert torch.equal(chunked, _prompt_logits(fp8, ids, 1000))


@pytest.mark.slow
def test_prefix_cache_hit_equals_the_cold_run_and_the_auto_cache(v41_dir):
    shared = _ids(5, 128)
    first, second = shared + _ids(6, 5), shared + _ids(7, 9)
    hit, cold = prefix_hit_and_cold_run(v41_dir, first, second, kv_cache_dtype="fp8")
    auto, _ = prefix_hit_and_cold_run(v41_dir, first, second)
    _same([hit, hit], [cold, auto])


@pytest.mark.slow
def test_preempted_requests_equal_the_auto_cache(v41_dir):
    def engine(kv_cache_dtype: str) -> LLMEngine:
        cfg = EngineConfig(
            model=str(v41_dir),
            backend="reference",
            dtype="float32",
            max_num_seqs=2,
            max_num_batched_tokens=32,
            page_size=16,
            num_cache_pages=7,  # 112 positions for two requests of ~80: one is preempted
            max_model_len=112,
            kv_cache_dtype=kv_cache_dtype,
        )
        return LLMEngine(cfg, plugins=v41_plugins())

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    requests = {f"r{i}": (_ids(40 + i, n), params) for i, n in enumerate((60, 55))}
    outs = {}
    for kind in ("fp8", "auto"):
        eng = engine(kind)
        outs[kind] = _run(eng, requests, {}, 10_000)
        assert eng.metrics.num_preemptions > 0
    _same([outs["fp8"][r] for r in requests], [outs["auto"][r] for r in requests])


def test_speculative_rollback_equals_the_auto_cache(v41_dir):
    """Rejected drafts land in the spare ring rows and in entries not yet visible, written by
    row into the packed pools as into plain ones."""
    base = [5, 17, 42, 99, 7, 256, 311, 5, 64, 128, 3]
    prompts = [{"prompt_token_ids": base * 3}, {"prompt_token_ids": _ids(11, 37) + base * 2}]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    spec = SpeculativeConfig(method="fixed", drafter="ngram", max_draft_tokens=4)
    fast = v41_llm(v41_dir, kv_cache_dtype="fp8", max_num_seqs=2, speculative=spec)
    got = fast.generate(prompts, params, use_tqdm=False)
    assert fast.get_metrics()["speculative"]["num_draft_tokens"] > 0
    want = v41_llm(v41_dir, max_num_seqs=2, speculative=spec).generate(prompts, params, use_tqdm=False)
    _same(got, want)


def test_widths_of_partial_blocks_keep_the_plain_format(v41_plain_dir, caplog):
    """Head 24 and indexer 16 are no whole number of 32- (16-) value blocks except the entries'
    (24 = 1.5 blocks of 16: no): ``kv_qdq`` leaves such rows unchanged, so the caches stay plain
    (logged) and the results are the auto cache's."""
    with caplog.at_level(logging.INFO, logger="deepinfer.model"):
        runner = _runner(v41_plain_dir, kv_cache_dtype="fp8")
    assert "kept in the model dtype" in caplog.text and "window (24 values" in caplog.text
    for layer, layer_specs in enumerate(runner.model.cache_specs("fp8")):
        for spec in layer_specs:
            if isinstance(spec, RingSpec | PagedSpec):
                assert spec.kv_format == "plain" and isinstance(
                    runner.cache.get(layer, spec.name), torch.Tensor
                )
    prompts = [{"prompt_token_ids": _ids(50, 40)}]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    got = v41_llm(v41_plain_dir, kv_cache_dtype="fp8").generate(prompts, params, use_tqdm=False)
    _same(got, v41_llm(v41_plain_dir).generate(prompts, params, use_tqdm=False))
