"""DeepSeek-V4.1 in the engine against the independent oracle, and the engine against itself.

On ``v41_plain_dir`` (KV numerics skipped by shape) the engine equals the oracle to float32
round-off and generates its greedy tokens.  On ``v41_dir`` (the release's FP8/FP4 KV numerics
on) a rounding can flip on the last bit of an fp32 sum, so the oracle comparison bounds how many
positions may differ, and the engine-against-itself properties (cached = uncached, chunked =
unchunked, continuous batching = one at a time, prefix hit = cold run) are checked bitwise in
batch-invariant mode.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer_core.config import EngineConfig
from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.models.cache_spec import PagedSpec, SlotStateSpec, spec_bytes
from deepinfer_core.models.deepseek_v41.family import FAMILY
from deepinfer_core.models.deepseek_v41.tiny import dequantized_weights, make_tiny, native_tensors
from deepinfer_core.ops import OpTable
from deepinfer_core.sampling.params import SamplingParams
from tests.models.v41.conftest import prefix_hit_and_cold_run, v41_llm
from tests.models.v41.oracle import OracleV41

LOGIT_ATOL = 1e-4  # float32: the engine and the oracle differ only in summation order


def _runner(path: Path, ops: OpTable | None = None, **kw) -> ModelRunner:
    cfg = EngineConfig(model=str(path), dtype="float32", max_num_seqs=4, **kw)
    return ModelRunner.load(
        path, cfg, ops or OpTable.reference(), family=FAMILY, model_config=FAMILY.from_file(path)
    )


def _prompt_logits(runner: ModelRunner, ids: list[int], chunk: int, slot: int = 0) -> torch.Tensor:
    kv = runner.kv_cache
    pages = kv.allocate_pages(kv.pages_needed(len(ids)))
    out = []
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        out.append(runner.execute([SeqChunk(slot, part, s, pages, sample=True, all_logits=True)]))
    kv.free_pages(pages)
    return torch.cat(out)


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("chunk", [1000, 7])
def test_prompt_logits_match_the_oracle(v41_plain_dir, chunk):
    """60 tokens: ~30 ratio-2 and 60 ratio-1 entries, so both levels of the top-k select."""
    ids = _ids(1, 60)
    ours = _prompt_logits(_runner(v41_plain_dir), ids, chunk)
    ref = OracleV41(v41_plain_dir).logits(ids)
    torch.testing.assert_close(ours, ref, atol=LOGIT_ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_engram_is_live_in_the_oracle_comparison(v41_plain_dir):
    """The tiny model's Engram layers (1 and 4) move its logits: without their lookups the engine
    no longer agrees with the oracle; and a look-back ring that leaked another request's ids would
    break the continuous-batching tests below."""
    ids = _ids(1, 40)
    ops = OpTable.reference()
    ops._fns["deepseek_v41.engram_mix"] = lambda streams, kv, q, k, eps: streams
    ours = _prompt_logits(_runner(v41_plain_dir, ops=ops), ids, 1000)
    assert (ours - OracleV41(v41_plain_dir).logits(ids)).abs().amax(-1).min() > 1e-2


def test_kv_numerics_match_the_oracle(v41_dir):
    """With the release's FP8 window / FP4 entry and indexer numerics: most positions at round-off
    (a flipped rounding moves a few); without the numerics almost none would be."""
    ids = _ids(2, 60)
    ref = OracleV41(v41_dir).logits(ids)
    ours = _prompt_logits(_runner(v41_dir, batch_invariant=True), ids, 1000)
    close = (ours - ref).abs().amax(-1) <= LOGIT_ATOL
    assert close.float().mean() >= 0.8, close
    ops = OpTable.reference()
    ops._fns["deepseek_v41.kv_qdq"] = lambda x, fmt, block: x  # numerics off: the oracle disagrees
    plain = _prompt_logits(_runner(v41_dir, ops=ops), ids, 1000)
    assert ((plain - ref).abs().amax(-1) <= LOGIT_ATOL).float().mean() < 0.2


def test_greedy_generation_through_continuous_batching_matches_the_oracle(v41_plain_dir):
    """Prompts of several lengths, chunked prefill under a small token budget, fewer slots than
    prompts: every request's tokens are the oracle's greedy ones (full recompute per token)."""
    prompts = [_ids(10 + i, n) for i, n in enumerate((5, 23, 41, 58))]
    llm = v41_llm(v41_plain_dir, max_num_seqs=3, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    oracle = OracleV41(v41_plain_dir)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, 6), f"prompt of {len(p)} tokens diverged"


def test_cached_decode_equals_uncached_recompute_bitwise(v41_dir):
    """Prefill then decode token by token over the caches = one uncached pass over the whole
    sequence, bit for bit (batch-invariant mode)."""
    prompt = _ids(3, 30)
    runner = _runner(v41_dir, batch_invariant=True)
    kv = runner.kv_cache
    seq = list(prompt)
    pages = kv.allocate_pages(kv.pages_needed(len(prompt) + 8))
    logits = [runner.execute([SeqChunk(0, prompt, 0, pages, sample=True)])]
    for _ in range(8):
        seq.append(int(logits[-1][-1].argmax()))
        logits.append(runner.execute([SeqChunk(0, seq[-1:], len(seq) - 1, pages, sample=True)]))
    cached = torch.cat(logits)
    full = _prompt_logits(_runner(v41_dir, batch_invariant=True), seq, 1000)[len(prompt) - 1 :]
    assert torch.equal(cached, full)


@pytest.mark.parametrize("chunk", [7, pytest.param(1, marks=pytest.mark.slow)])
def test_chunked_prefill_equals_unchunked_bitwise(v41_dir, chunk):
    ids = _ids(4, 50)
    runner = _runner(v41_dir, batch_invariant=True)
    assert torch.equal(_prompt_logits(runner, ids, chunk), _prompt_logits(runner, ids, 1000))


@pytest.mark.slow
def test_continuous_batching_equals_one_at_a_time_bitwise(v41_dir):
    prompts = [_ids(20 + i, n) for i, n in enumerate((9, 33, 47))]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    batched = v41_llm(v41_dir, batch_invariant=True, max_num_seqs=3, max_num_batched_tokens=20)
    outs = batched.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    alone = v41_llm(v41_dir, batch_invariant=True, max_num_seqs=1)
    for p, out in zip(prompts, outs, strict=True):
        [single] = alone.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        assert out.outputs[0].token_ids == single.outputs[0].token_ids
        assert out.outputs[0].logprobs == single.outputs[0].logprobs


def test_prefix_cache_hit_equals_cold_run_bitwise(v41_dir):
    """A second request sharing a long prefix reuses its cached pages (compressed entries and
    indexer keys of every group) and replays the exact window tail: the same tokens and
    logprobs as a cold engine."""
    shared = _ids(5, 128)
    first, second = shared + _ids(6, 5), shared + _ids(7, 9)
    hit, ref = prefix_hit_and_cold_run(v41_dir, first, second)
    assert hit.outputs[0].token_ids == ref.outputs[0].token_ids
    assert hit.outputs[0].logprobs == ref.outputs[0].logprobs


def test_seeded_sampling_is_deterministic(v41_dir):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=1234, ignore_eos=True)
    prompt = [{"prompt_token_ids": _ids(8, 17)}]
    a = v41_llm(v41_dir).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    b = v41_llm(v41_dir).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and len(a) == 8


def test_one_cache_allocation_per_source_group(v41_dir):
    """Each kv source owns its group's entry and indexer-key pools; every other layer of the group
    declares them ``alias_of`` the source and costs no memory."""
    runner = _runner(v41_dir)
    specs = runner.model.cache_specs()
    paged = {(i, s.name): s for i, layer in enumerate(specs) for s in layer if isinstance(s, PagedSpec)}
    owners = {k for k, s in paged.items() if s.alias_of is None}
    assert owners == {(2, "ckv"), (2, "ikv"), (4, "ckv"), (4, "ikv"), (6, "ckv"), (6, "ikv")}
    assert paged[(3, "ckv")].alias_of == (2, "ckv") and (3, "ikv") not in paged  # Reuse: no keys read
    assert paged[(5, "ikv")].alias_of == (4, "ikv")  # Reindex scores the source's keys
    assert {paged[(i, "ckv")].alias_of for i in (7, 8, 9)} == {(6, "ckv")}
    assert paged[(8, "ikv")].alias_of == (6, "ikv")
    assert all(spec_bytes(s, 16, torch.float32) == (0, 0) for s in paged.values() if s.alias_of)
    cache = runner.cache
    for layer, src in ((3, 2), (5, 4), (9, 6)):
        assert cache.get(layer, "ckv") is cache.get(src, "ckv")
    assert not specs[0][1:]  # a sliding-only layer: just its window
    # the Engram look-back ring (3 ids per slot), with the first Engram layer's caches
    assert specs[1][1:] == [SlotStateSpec("engram.ids", (3,), dtype=torch.int64)]


@pytest.mark.parametrize("keep_quantized", [False, True])
def test_mxfp8_mxfp4_checkpoint_equals_the_model_on_its_dequantised_weights(tmp_path, keep_quantized):
    """The release's formats (MXFP8 32x32 ue8m0 dense linears, MXFP4 experts): the same logits
    as a plain checkpoint of the dequantised weights (bit for bit when dequantised at load; kept
    quantised, the fused input projections run one matmul per format); and the oracle,
    dequantising on its own, agrees."""
    from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config
    from deepinfer_core.models.deepseek_v41.tiny import tiny_config
    from tests.models.v41.conftest import PLAIN_CHANGES

    config = tiny_config(**PLAIN_CHANGES)
    quantized = make_tiny(tmp_path / "q", config=config, fp8_linear=True, fp4_experts=True)
    plain = make_tiny(tmp_path / "p", config=config)  # then overwritten with the dequantised weights
    cfg = DeepseekV41Config.from_dict(config, "tiny")
    from safetensors.torch import save_file

    save_file(native_tensors(dequantized_weights(quantized), cfg), str(plain / "model.safetensors"))
    ids = _ids(9, 40)
    ours = _prompt_logits(_runner(quantized, keep_quantized=keep_quantized), ids, 1000)
    reference = _prompt_logits(_runner(plain), ids, 1000)
    if keep_quantized:  # the same values, but fused projections split into one matmul per format
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    else:
        assert torch.equal(ours, reference)
    torch.testing.assert_close(ours, OracleV41(quantized).logits(ids), atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("quantized", [False, True])
def test_engram_tables_are_memory_mapped_not_copied(tmp_path, quantized, device):
    """The loaded table is a view of the checkpoint file — on a CPU device the mapping itself,
    on a CUDA device a device view of it (page-locked host memory read in place): a change to
    the file's bytes shows through (nothing was copied); a quantised table stays e4m3 with its
    scales."""
    import json

    from deepinfer_core.weights.quant import QuantizedTensor

    path = make_tiny(tmp_path / "m", fp8_linear=quantized, fp4_experts=quantized)
    cfg = FAMILY.from_file(path)
    weights = FAMILY.load_weights(path, cfg, torch.float32, torch.device(device), ())
    table = weights["layers.4.engram.embed.weight"]
    data = table.data if quantized else table
    assert isinstance(table, QuantizedTensor) == quantized and not data.is_inference()
    assert data.device.type == device
    assert data.view(torch.uint8).any()  # (bytes: CUDA has no abs of e4m3)
    shard = path / "model.safetensors"
    raw = shard.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8 : 8 + size])["layers.4.engram.embed.weight"]["data_offsets"]
    with open(shard, "r+b") as f:
        f.seek(8 + size + begin)
        f.write(bytes(end - begin))
    assert not data.view(torch.uint8).any()


@pytest.mark.slow
def test_speculative_ngram_decoding_is_lossless(v41_dir):
    """Verify steps of up to 4 drafts rolled back by position alone (spare ring rows for the
    window and the Engram look-back, spare compressor windows; entries of rejected positions are
    invisible until rewritten): the same greedy tokens as plain decoding, bit for bit."""
    from deepinfer_core.config import SpeculativeConfig

    base = [5, 17, 42, 99, 7, 256, 311, 5, 64, 128, 3]
    prompts = [{"prompt_token_ids": base * 3}, {"prompt_token_ids": _ids(11, 37) + base * 2}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = SpeculativeConfig(method="fixed", drafter="ngram", max_draft_tokens=4)
    fast = v41_llm(v41_dir, batch_invariant=True, max_num_seqs=2, speculative=spec)
    outs = fast.generate(prompts, params, use_tqdm=False)
    # verify steps ran; the random tiny model rejects most drafts, which is what rollback must survive
    assert fast.get_metrics()["speculative"]["num_draft_tokens"] > 0
    plain = v41_llm(v41_dir, batch_invariant=True, max_num_seqs=2).generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
