"""Sampling parameters end to end through LLM on the built-in tiny model."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.errors import SamplingParamsError
from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog again and again",
    "A",
    "Once upon a time",
]


@pytest.fixture(scope="module")
def small() -> LLM:
    """Tiny token budget (chunked prefill), 2 sequences, a cache too small for all: preemptions."""
    return LLM(
        model=str(builtin_tiny_model_dir()),  # the module's `llm`'s model
        backend="reference",
        max_num_seqs=2,
        max_num_batched_tokens=5,
        num_cache_pages=3,
        page_size=16,
    )


def token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def full_prompt_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits of every prompt position from one unchunked forward (the runner, called directly)."""
    runner = llm.engine.runner
    kv = runner.kv_cache
    slot, pages = kv.allocate_slot(), kv.allocate_pages(kv.pages_needed(len(ids)))
    try:
        return runner.execute([SeqChunk(slot, ids, 0, pages, sample=True, all_logits=True)])
    finally:
        kv.free_pages(pages)
        kv.free_slot(slot)


@pytest.mark.slow
def test_seeded_sampling_is_independent_of_batch_chunking_and_preemption(llm, small):
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=10),
        SamplingParams(temperature=0.8, top_k=20, min_p=0.05, seed=12, max_tokens=10),
        SamplingParams(temperature=1.2, seed=13, max_tokens=10, presence_penalty=0.5),
        SamplingParams(n=2, temperature=1.0, seed=14, max_tokens=10, repetition_penalty=1.3),
    ]
    alone = [token_ids(llm.generate(p, sp))[0] for p, sp in zip(PROMPTS, params, strict=True)]
    together = token_ids(llm.generate(PROMPTS, params))
    reordered = token_ids(llm.generate(PROMPTS[::-1], params[::-1]))[::-1]
    before = small.engine.scheduler.num_preemptions
    constrained = token_ids(small.generate(PROMPTS, params))
    assert small.engine.scheduler.num_preemptions > before, "the small cache must force preemption"
    assert together == alone and reordered == alone and constrained == alone
    assert alone[3][0] != alone[3][1]  # the n samples differ


def test_stop_string_truncates_text_and_sets_stop_reason(llm):
    base = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    text = base.text
    assert len(text) > 12
    stop = text[5:9]
    cut = text.find(stop)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:cut], "stop", stop)
    assert base.token_ids[: len(out.token_ids)] == out.token_ids  # generation stopped early, same tokens
    assert len(out.token_ids) < len(base.token_ids)
    incl = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, stop=stop, include_stop_str_in_output=True)
    )[0].outputs[0]
    assert incl.text == text[: cut + len(stop)] and incl.stop_reason == stop


def test_stop_token_id_reason_and_min_tokens(llm):
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    first = base.token_ids[0]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]))
    comp = out[0].outputs[0]
    assert (comp.token_ids, comp.finish_reason, comp.stop_reason, comp.text) == ([first], "stop", first, "")
    delayed = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=3)
    )[0].outputs[0]
    assert first not in delayed.token_ids[:3] and len(delayed.token_ids) >= 3
    if first in delayed.token_ids:
        assert delayed.token_ids[-1] == first and delayed.stop_reason == first


def test_prompt_logprobs_are_log_softmax_of_the_full_prompt_logits(llm, small):
    k = 3
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    expected = torch.log_softmax(full_prompt_logits(llm, ids).double(), dim=-1)
    for engine in (llm, small):  # small: the prompt arrives in 5-token chunks
        out = engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, prompt_logprobs=k))[0]
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(ids) and plp[0] is None
        for pos in range(1, len(ids)):
            row = expected[pos - 1]
            top = set(row.topk(k).indices.tolist())
            assert set(plp[pos]) == top | {ids[pos]}
            for tok, lp in plp[pos].items():
                assert lp == pytest.approx(row[tok].item(), abs=1e-4)


def test_logprobs_and_cumulative_logprob(llm):
    comp = llm.generate(PROMPTS[3], SamplingParams(temperature=0.9, seed=3, max_tokens=5, logprobs=2))[0]
    c = comp.outputs[0]
    assert len(c.logprobs) == 5
    assert c.cumulative_logprob == pytest.approx(
        sum(lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True))
    )
    plain = llm.generate(PROMPTS[3], SamplingParams(temperature=0.9, seed=3, max_tokens=5))[0].outputs[0]
    assert plain.cumulative_logprob is None and plain.token_ids == c.token_ids


def test_logit_bias_and_allowed_token_ids_steer_generation(llm):
    forced = llm.generate(
        PROMPTS[0], SamplingParams(temperature=1.0, seed=1, max_tokens=5, logit_bias={77: 100})
    )
    assert forced[0].outputs[0].token_ids == [77] * 5
    allowed = [40, 41, 300]
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=1.5, seed=2, max_tokens=12, allowed_token_ids=allowed)
    )
    assert set(out[0].outputs[0].token_ids) <= set(allowed)


def test_repetition_penalty_changes_greedy_choice_as_computed(llm):
    """The greedy token under repetition_penalty equals the argmax of the hand-penalised logits."""
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    logits = full_prompt_logits(llm, ids)[-1]
    rp = 1.8
    penalised = logits.clone()
    for t in set(ids):
        penalised[t] = penalised[t] / rp if penalised[t] > 0 else penalised[t] * rp
    got = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, repetition_penalty=rp)
    )
    assert got[0].outputs[0].token_ids == [int(penalised.argmax())]


def test_skip_special_tokens_keeps_special_text(llm):
    tok = llm.get_tokenizer()
    special = sorted(tok.special_token_ids - set(tok.eos_token_ids))[0]
    p = SamplingParams(temperature=0, max_tokens=2, logit_bias={special: 100})
    skipped = llm.generate(PROMPTS[0], p)[0].outputs[0]
    kept = llm.generate(PROMPTS[0], p.replace(skip_special_tokens=False))[0].outputs[0]
    assert skipped.token_ids == kept.token_ids == [special, special]
    assert skipped.text == "" and kept.text == tok.decode([special] * 2, skip_special_tokens=False) != ""


@pytest.mark.parametrize(
    "params,needle",
    [
        (SamplingParams(logit_bias={10**6: 1.0}), "1000000"),
        (SamplingParams(allowed_token_ids=[1, 99999]), "99999"),
        (SamplingParams(stop_token_ids=[123456]), "123456"),
    ],
)
def test_out_of_vocab_ids_are_rejected_before_anything_is_queued(llm, params, needle):
    with pytest.raises(SamplingParamsError, match=needle):
        llm.generate(PROMPTS[:2], [SamplingParams(), params])
    assert not llm.engine.has_unfinished()
