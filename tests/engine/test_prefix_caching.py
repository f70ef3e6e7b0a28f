"""Prefix caching over the hybrid cache with SWA bounded replay (oracle: a cold run and HF)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def model_dir(hf_model):
    return hf_model("all_types")[1]


def _prompts(seed: int, prefix_len: int, suffix_lens: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, 300, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(2, 300, (n,), generator=g).tolist() for n in suffix_lens]


def _llm(model_dir, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 64)
    return LLM(model=str(model_dir), backend="reference", dtype="float32", max_num_seqs=4, page_size=16, **kw)


def _record_schedules(llm: LLM) -> list:
    """Keep every SchedulerOutput the engine produces (observation only)."""
    seen = []
    sched = llm.engine.scheduler
    inner = sched.schedule

    def schedule():
        out = inner()
        seen.append(out)
        return out

    sched.schedule = schedule
    return seen


def _expected_replay(llm: LLM) -> int:
    runner = llm.engine.runner
    p, w, n = runner.page_size, runner.model_config.sliding_window, runner.model_config.num_hidden_layers

    def align(x: int) -> int:
        return -(-x // p) * p

    return align(align(w) + (n - 1) * w)


@pytest.mark.parametrize("budget", [64, 24, pytest.param(7, marks=pytest.mark.slow)])
def test_prefix_hit_equals_cold_run_and_replays_only_the_window_bound(model_dir, budget):
    first, second = _prompts(0, 131, [9, 14])
    cold = _llm(model_dir, enable_prefix_caching=False, max_num_batched_tokens=budget)
    want = cold.generate([{"prompt_token_ids": second}], GREEDY)[0].outputs[0]

    warm = _llm(model_dir, max_num_batched_tokens=budget)
    warm.generate([{"prompt_token_ids": first}], GREEDY)
    seen = _record_schedules(warm)
    got = warm.generate([{"prompt_token_ids": second}], GREEDY)[0].outputs[0]

    assert got.token_ids == want.token_ids
    for lp_got, lp_want in zip(got.logprobs, want.logprobs, strict=True):
        assert lp_got.keys() == lp_want.keys()
        for tok, value in lp_want.items():
            assert abs(lp_got[tok] - value) < 1e-4
    hit = sum(s.num_prefix_hit_tokens for s in seen)
    replayed = sum(s.num_replayed_tokens for s in seen)
    assert hit == 128  # 8 full pages of the shared 131-token prefix
    assert replayed == _expected_replay(warm) == 48  # align(align(8,16) + 3*8, 16)
    prefill = sum(c.num_tokens for s in seen for c in s.chunks if c.start_pos < len(second))
    assert prefill == len(second) - (hit - replayed)  # measurably cheaper than len(second)


@pytest.mark.slow
def test_prefix_hit_matches_hf_greedy(model_dir):
    from transformers import DeepseekV4ForCausalLM

    prompts = _prompts(1, 70, [5, 11, 3])
    llm = _llm(model_dir)
    outs = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in prompts]  # 2nd and 3rd hit
    hf = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(p) :].tolist()


def test_replay_never_rewrites_cached_pages(model_dir):
    first, second = _prompts(2, 96, [20, 30])
    llm = _llm(model_dir)
    llm.generate([{"prompt_token_ids": first}], GREEDY)
    runner = llm.engine.runner
    kv = runner.kv_cache
    pages, _ = kv.match_prefix(second, len(second) - 1)
    kv.free_pages(pages)  # only looked up
    assert len(pages) == 6
    layers = range(runner.model_config.num_hidden_layers)
    names = ("ckv", "ikv", "ckv.page_carry_kv", "ikv.page_carry_kv")

    def page_rows(tensor: torch.Tensor) -> torch.Tensor:
        per_page = tensor.shape[0] // kv.num_pages
        return torch.cat([tensor[p * per_page : (p + 1) * per_page] for p in pages])

    before = {}
    for layer in layers:
        for name in names:
            try:
                before[layer, name] = page_rows(runner.cache.get(layer, name))
            except KeyError:
                continue
    seen = _record_schedules(llm)
    llm.generate([{"prompt_token_ids": second}], GREEDY)
    assert sum(s.num_prefix_hit_tokens for s in seen) == 96
    assert before
    for (layer, name), old in before.items():
        assert torch.equal(page_rows(runner.cache.get(layer, name)), old), (layer, name)


def test_cached_pages_are_evicted_lru_and_never_leak(model_dir):
    llm = _llm(model_dir, num_cache_pages=12)
    kv = llm.engine.runner.kv_cache
    for seed in range(4):  # each run caches pages; later ones evict earlier ones
        llm.generate([{"prompt_token_ids": p} for p in _prompts(10 + seed, 60, [4, 9])], GREEDY)
        assert kv.num_free_pages == kv.num_pages
    assert 0 < kv.num_cached_pages <= kv.num_pages
