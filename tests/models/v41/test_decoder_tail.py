"""DeepSeek-V4.1's decoder-side prefill tail (``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``) against
the full prefill of the same model.

The oracle is the engine with the tail off (every row through every layer), itself checked
against the independent full-recompute oracle in ``test_v41_model.py``.  On the tiny model
(window ``W = 8``, ``D = 3`` decoder layers 7..9 after the last kv source 6) the tail's error is
exactly where the receptive-field argument puts it: decoder layer ``k``'s window keys over the
last window are bitwise right once ``tail >= W + (k - 1)(W - 1)``, the last-token logits once
``tail >= D(W - 1) + 1 = 22``; below that the logits move, by at most :data:`LOGIT_BOUND`.
Comparisons run in batch-invariant mode (fp32), where a row's result does not depend on the
other rows computed with it, so "equal" means bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer_core.config import EngineConfig
from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config
from deepinfer_core.models.deepseek_v41.family import FAMILY
from deepinfer_core.models.deepseek_v41.model import TAIL_ENV, prefill_tail_setting
from deepinfer_core.models.deepseek_v41.tiny import TINY_CONFIG
from deepinfer_core.ops import OpTable
from deepinfer_core.sampling.params import SamplingParams
from tests.models.v41.conftest import prefix_hit_and_cold_run, v41_llm

W, DECODER = 8, (7, 8, 9)  # the tiny model's window and its layers after the last kv source
EXACT = len(DECODER) * (W - 1) + 1  # 22: the tail from which the last-token logits are exact
LOGIT_BOUND = 1.0
"""Max |logit difference| of the last token with the default tail (``W`` here): measured up to
0.79 over 24 prompts of 30..200 tokens (logits of std ~1, so a random tiny model's argmax can
flip); 0.09 and 0.10 on the two prompts below, 0.03 with a tail of 12, 0.008 with 15."""


def _runner(path: Path, monkeypatch: pytest.MonkeyPatch, tail: int | str | None, **kw) -> ModelRunner:
    if tail is None:
        monkeypatch.delenv(TAIL_ENV, raising=False)
    else:
        monkeypatch.setenv(TAIL_ENV, str(tail))
    cfg = EngineConfig(model=str(path), dtype="float32", max_num_seqs=4, batch_invariant=True, **kw)
    ops = OpTable.reference()
    return ModelRunner.load(path, cfg, ops, family=FAMILY, model_config=FAMILY.from_file(path))


def _prefill(runner: ModelRunner, ids: list[int], chunk: int = 10**6, slot: int = 0) -> torch.Tensor:
    """Prefill ``ids`` into ``slot`` in chunks of ``chunk``; the last token's logits ``[1, V]``."""
    kv = runner.kv_cache
    pages = kv.allocate_pages(kv.pages_needed(len(ids)))
    for s in range(0, len(ids), chunk):
        last = s + chunk >= len(ids)
        out = runner.execute([SeqChunk(slot, ids[s : s + chunk], s, pages, sample=last)])
    kv.free_pages(pages)
    return out


def _rings(runner: ModelRunner, slot: int = 0) -> list[torch.Tensor]:
    """Each decoder layer's window ring of ``slot`` (``W`` rows: the last window's keys)."""
    return [runner.cache.get(layer, "window")[slot * W : (slot + 1) * W].clone() for layer in DECODER]


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_tail_setting():
    cfg = DeepseekV41Config.from_dict(TINY_CONFIG, source="tiny")
    assert [prefill_tail_setting(cfg, v) for v in ("", "0", "off", "auto", "8", "140")] == [
        None,
        None,
        None,
        "auto",
        8,
        140,
    ]
    for bad in ("7", "lots"):
        with pytest.raises(ConfigError, match=f"{TAIL_ENV}=.*sliding window \\(8\\)") as e:
            prefill_tail_setting(cfg, bad)
        assert "\n" not in str(e.value)


def test_the_decoder_layers_run_on_each_requests_tail_only(v41_dir, monkeypatch):
    """The plan of a step with a 100-token prompt and a 5-token prompt: the first keeps its last
    ``W`` rows, the second all of its rows; padding up to the static bound ``R * tail + N``."""
    runner = _runner(v41_dir, monkeypatch, "auto")
    kv = runner.kv_cache
    a, b = kv.allocate_pages(kv.pages_needed(100)), kv.allocate_pages(kv.pages_needed(5))
    chunks = [SeqChunk(0, _ids(1, 100), 0, a), SeqChunk(1, _ids(2, 5), 0, b)]
    from deepinfer_core.contract.batch import sample_rows

    inputs = runner.inputs.prepare(chunks, sample_rows(chunks), None)
    md = runner._metadata(runner.model.step_metadata, inputs)
    assert md.tail is not None
    kept = list(range(100 - W, 105))
    assert md.tail.rows.tolist() == kept + [0] * (2 * W + 2 - len(kept))
    assert md.tail.md.sample_rows.tolist() == [W - 1, W + 4]
    assert md.tail.md.positions[: len(kept)].tolist() == list(range(100 - W, 100)) + list(range(5))
    # a decode-only step keeps every row: no plan, the step runs as without the tail
    decode = [SeqChunk(0, [3], 100, a), SeqChunk(1, [4], 5, b)]
    inputs = runner.inputs.prepare(decode, sample_rows(decode), None)
    assert runner._metadata(runner.model.step_metadata, inputs).tail is None


def test_caches_and_last_token_logits_against_full_prefill(v41_dir, monkeypatch):
    """Per tail: decoder layer ``k``'s last-window keys are bitwise the full prefill's exactly
    from ``W + (k-1)(W-1)`` on; the last-token logits from ``D(W-1)+1`` on, and within
    :data:`LOGIT_BOUND` below it (the default tail ``W`` included), shrinking as the tail grows."""
    prompts = [_ids(3, 100), _ids(4, 61)]
    full = _runner(v41_dir, monkeypatch, None)
    refs = []
    for ids in prompts:
        refs.append((_prefill(full, ids), _rings(full)))
    errors = {}
    for tail in ("auto", 12, 15, EXACT):
        runner = _runner(v41_dir, monkeypatch, tail)
        n = W if tail == "auto" else tail
        for ids, (ref, ref_rings) in zip(prompts, refs, strict=True):
            out = _prefill(runner, ids)
            for k, (ring, want) in enumerate(zip(_rings(runner), ref_rings, strict=True)):
                assert torch.equal(ring, want) == (n >= W + k * (W - 1)), f"tail {n}, layer {DECODER[k]}"
            errors[n, len(ids)] = err = (out - ref).abs().max().item()
            assert (err == 0) == (n >= EXACT), f"tail {n}: last-token logit error {err}"
            assert err <= LOGIT_BOUND
    for p in prompts:  # the error shrinks as the tail grows
        assert errors[W, len(p)] > errors[12, len(p)] > errors[15, len(p)] > errors[EXACT, len(p)] == 0


def test_exact_tail_generates_the_full_prefill_tokens(v41_dir, monkeypatch):
    """Greedy generation through the engine (chunked prefill, continuous batching) with the
    exact tail: the full prefill's tokens and logprobs.  (With the default tail a random tiny
    model's greedy tokens can differ: its logits move by up to :data:`LOGIT_BOUND`.)"""
    prompts = [{"prompt_token_ids": _ids(10 + i, n)} for i, n in enumerate((90, 47, 12))]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    opts = dict(batch_invariant=True, max_num_seqs=3, max_num_batched_tokens=64)
    monkeypatch.delenv(TAIL_ENV, raising=False)
    ref = v41_llm(v41_dir, **opts).generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv(TAIL_ENV, str(EXACT))
    exact = v41_llm(v41_dir, **opts).generate(prompts, params, use_tqdm=False)
    for r, e in zip(ref, exact, strict=True):
        assert e.outputs[0].token_ids == r.outputs[0].token_ids
        assert e.outputs[0].logprobs == r.outputs[0].logprobs


def test_prompt_logprobs_requests_get_the_full_prefill(v41_dir, monkeypatch):
    """A request with prompt logprobs keeps every row (its prompt logprobs and tokens are the
    full prefill's), while a request in the same step without them still gets the tail."""
    a, b = _ids(20, 70), _ids(21, 66)
    want = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    reqs = [{"prompt_token_ids": a}, {"prompt_token_ids": b}]
    opts = dict(batch_invariant=True, max_num_seqs=2, max_num_batched_tokens=256)
    monkeypatch.delenv(TAIL_ENV, raising=False)
    ref = v41_llm(v41_dir, **opts).generate(reqs, [want, plain], use_tqdm=False)
    monkeypatch.setenv(TAIL_ENV, "auto")
    llm = v41_llm(v41_dir, **opts)
    got = llm.generate(reqs, [want, plain], use_tqdm=False)
    [alone] = llm.generate(reqs[1:], [plain], use_tqdm=False)
    assert got[0].prompt_logprobs == ref[0].prompt_logprobs and len(got[0].prompt_logprobs) == len(a)
    assert got[0].outputs[0].logprobs == ref[0].outputs[0].logprobs
    assert got[1].outputs[0].logprobs == alone.outputs[0].logprobs  # the tail, whatever its batchmates
    assert got[1].outputs[0].logprobs != ref[1].outputs[0].logprobs


@pytest.mark.parametrize("chunk", [30, 37])
def test_chunked_prefill_with_the_tail(v41_dir, monkeypatch, chunk):
    """100 tokens in chunks of 30 (last chunk 10 >= tail) equal the unchunked tail run bitwise;
    in chunks of 37 (last chunk 26, the exact tail 22 fits) as well, and with the exact tail
    both equal the full prefill."""
    ids = _ids(5, 100)
    runner = _runner(v41_dir, monkeypatch, "auto")
    assert torch.equal(_prefill(runner, ids, chunk), _prefill(runner, ids))
    exact = _runner(v41_dir, monkeypatch, EXACT)
    ref = _prefill(_runner(v41_dir, monkeypatch, None), ids)
    assert torch.equal(_prefill(exact, ids, chunk), ref)


def test_a_last_chunk_shorter_than_the_tail(v41_dir, monkeypatch):
    """A last chunk of 4 < tail tokens: its rows read the previous chunk's last ``tail`` decoder
    rows (all computed), so with the exact tail the result is still the full prefill's and with
    the default tail within the bound."""
    ids = _ids(6, 100)
    ref = _prefill(_runner(v41_dir, monkeypatch, None), ids)
    assert torch.equal(_prefill(_runner(v41_dir, monkeypatch, EXACT), ids, 48), ref)
    err = (_prefill(_runner(v41_dir, monkeypatch, "auto"), ids, 48) - ref).abs().max().item()
    assert 0 < err <= LOGIT_BOUND


@pytest.mark.slow
def test_prefix_cache_hit_with_the_tail(v41_dir, monkeypatch):
    """A prefix-cache hit (exact encoder replay, cached shared entries) then the tail: the same
    tokens and logprobs as a cold run with the tail."""
    shared = _ids(7, 128)
    first, second = shared + _ids(8, 5), shared + _ids(9, 30)
    monkeypatch.setenv(TAIL_ENV, "auto")
    hit, ref = prefix_hit_and_cold_run(v41_dir, first, second)
    assert hit.outputs[0].token_ids == ref.outputs[0].token_ids
    assert hit.outputs[0].logprobs == ref.outputs[0].logprobs


@pytest.mark.slow
def test_speculative_decoding_with_the_tail_is_lossless(v41_dir, monkeypatch):
    """With 4 draft tokens ``auto`` is ``W + 4``; verify steps keep every row (no plan), so ngram
    speculative decoding gives the tokens of plain decoding with the same tail."""
    from deepinfer_core.config import SpeculativeConfig

    base = [5, 17, 42, 99, 7, 256, 311, 5, 64, 128, 3]
    prompts = [{"prompt_token_ids": base * 3}, {"prompt_token_ids": _ids(11, 37) + base * 2}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = SpeculativeConfig(method="fixed", drafter="ngram", max_draft_tokens=4)
    monkeypatch.setenv(TAIL_ENV, "auto")
    fast = v41_llm(v41_dir, batch_invariant=True, max_num_seqs=2, speculative=spec)
    assert fast.engine.runner.model.tail_tokens(fast.engine.runner.num_spec_tokens) == W + 4
    outs = fast.generate(prompts, params, use_tqdm=False)
    assert fast.get_metrics()["speculative"]["num_draft_tokens"] > 0
    monkeypatch.setenv(TAIL_ENV, str(W + 4))
    plain = v41_llm(v41_dir, batch_invariant=True, max_num_seqs=2).generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
