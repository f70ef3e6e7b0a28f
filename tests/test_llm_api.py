"""LLM end-to-end on the built-in tiny model (real model runner, real scheduler, real sampler)."""

from __future__ import annotations

import types

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.errors import ConfigError, SamplingParamsError
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir
from deepinfer_core.plugins import get_plugins, reset_plugins

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog again and again",
    "A",
    "Once upon a time",
]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def solo(llm):
    """Greedy output of each prompt run alone (the engine's batch-of-one result)."""
    return [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def hf_greedy(model_dir, prompt_ids: list[int], n: int) -> list[int]:
    transformers = pytest.importorskip("transformers")
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt_ids) :].tolist()


def test_greedy_matches_transformers(llm, solo):
    """Independent oracle: HF transformers' DeepseekV4ForCausalLM greedy decoding of the same checkpoint."""
    outs = llm.generate(PROMPTS[:2], GREEDY)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(llm.config.model, out.prompt_token_ids, 6)


def test_output_shape_and_text(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5))[0]
    tok = llm.get_tokenizer()
    assert out.prompt == PROMPTS[0] and out.prompt_token_ids == tok.encode(PROMPTS[0])
    comp = out.outputs[0]
    assert comp.index == 0 and len(comp.token_ids) == 5 and comp.finish_reason == "length"
    assert comp.text == tok.decode(comp.token_ids) and out.finished and out.error is None
    assert comp.logprobs is None


def test_batching_chunking_and_preemption_do_not_change_greedy_outputs(solo):
    """Tiny budget (chunked prefill), 2 running seqs and a cache too small for all: same tokens."""
    small = LLM(
        model=str(builtin_tiny_model_dir()),
        backend="reference",
        max_num_seqs=2,
        max_num_batched_tokens=5,
        num_cache_pages=3,
        page_size=16,
    )
    prompts = PROMPTS + [{"prompt_token_ids": small.get_tokenizer().encode(PROMPTS[1])}]
    outs = small.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == solo + [solo[1]]
    assert small.engine.scheduler.num_preemptions > 0
    kv = small.engine.runner.kv_cache
    assert kv.num_free_pages == kv.num_pages and kv.num_free_slots == kv.num_slots


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=8)
    alone = llm.generate(PROMPTS[2], p)[0].outputs[0].token_ids
    mixed = llm.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[3]],
        [
            SamplingParams(temperature=0.8, max_tokens=3),
            p,
            SamplingParams(temperature=1.3, seed=9, max_tokens=12),
        ],
    )
    assert mixed[1].outputs[0].token_ids == alone
    other = llm.generate(PROMPTS[2], p.replace(seed=4321))[0].outputs[0].token_ids
    assert other != alone


def test_unseeded_sampling_follows_the_engine_seed():
    p = SamplingParams(temperature=1.0, max_tokens=8)
    a = LLM(backend="reference", seed=5).generate(PROMPTS[:2], p)
    b = LLM(backend="reference", seed=5).generate(PROMPTS[:2], p)
    c = LLM(backend="reference", seed=6).generate(PROMPTS[:2], p)
    ids = [[o.outputs[0].token_ids for o in outs] for outs in (a, b, c)]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_bad_requests_fail_alone(llm, solo):
    too_long = {"prompt_token_ids": [5] * (llm.config.max_model_len + 1)}
    outs = llm.generate([PROMPTS[0], {"prompt_token_ids": []}, too_long, PROMPTS[1]], GREEDY)
    assert [o.outputs[0].token_ids for o in (outs[0], outs[3])] == [solo[0], solo[1]]
    assert outs[1].outputs[0].finish_reason == "error" and "prompt is empty" in outs[1].error
    assert outs[2].outputs[0].finish_reason == "error" and "max_model_len" in outs[2].error
    assert outs[1].outputs[0].token_ids == [] and outs[0].error is None


def test_stop_token_ids_end_the_completion(llm, solo):
    stop = solo[0][3]
    first = solo[0].index(stop)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop]))[0]
    comp = out.outputs[0]
    assert comp.token_ids == solo[0][: first + 1] and comp.finish_reason == "stop"
    assert comp.text == llm.get_tokenizer().decode(solo[0][:first])


def test_eos_stops_unless_ignored(llm, solo):
    eos = llm.engine.eos_token_ids
    assert eos, "the tiny model declares an EOS id"
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = [solo[0][2]]  # pretend the third generated token is EOS
    try:
        stopped = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0]
        ignored = llm.generate(PROMPTS[0], GREEDY.replace(ignore_eos=True))[0].outputs[0]
    finally:
        engine.eos_token_ids = saved
    assert stopped.finish_reason == "stop" and stopped.token_ids == solo[0][: solo[0].index(solo[0][2]) + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == solo[0]


def test_max_model_len_caps_generation(solo):
    short = LLM(model=str(builtin_tiny_model_dir()), backend="reference", max_model_len=12)
    ids = short.get_tokenizer().encode(PROMPTS[0])
    out = short.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=50))[0].outputs[0]
    assert len(ids) + len(out.token_ids) == 12 and out.finish_reason == "length"
    assert out.token_ids == solo[0][: len(out.token_ids)]


def test_logprobs_are_the_models_raw_distribution(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[0])
    # recompute step by step with the runner on a fresh slot and compare
    runner = llm.engine.runner
    from deepinfer_core.contract.batch import SeqChunk

    kv = runner.kv_cache
    seq = list(prompt_ids)
    slot = kv.allocate_slot()
    pages = kv.allocate_pages(kv.pages_needed(len(seq) + 4))
    try:
        for step, tok in enumerate(out.token_ids):
            logits = runner.execute([SeqChunk(slot, seq, 0, pages, True)])[0]
            logp = torch.log_softmax(logits.double(), -1)
            top = logp.topk(3).indices.tolist()
            assert set(out.logprobs[step]) == set(top) | {tok}
            for t, lp in out.logprobs[step].items():
                assert lp == pytest.approx(logp[t].item(), abs=1e-4)
            assert tok == top[0]
            seq.append(tok)
    finally:
        kv.free_pages(pages)
        kv.free_slot(slot)


def test_n_samples_fan_out(llm):
    out = llm.generate(PROMPTS[3], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in seqs}) > 1
    again = llm.generate(PROMPTS[3], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6))[0]
    assert [c.token_ids for c in again.outputs] == seqs
    greedy = llm.generate(PROMPTS[3], SamplingParams(n=2, temperature=0, max_tokens=6))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_params_list_must_match_prompts(llm):
    with pytest.raises(SamplingParamsError, match="2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS[:3], [GREEDY, GREEDY])


def test_config_file_and_arguments_reach_the_engine(tmp_path):
    f = tmp_path / "engine.toml"
    f.write_text('max_num_seqs = 3\nmax_num_batched_tokens = 99\nbackend = "reference"\n')
    llm = LLM(config=f, max_num_batched_tokens=77)
    assert llm.config.max_num_seqs == 3 and llm.engine.scheduler.max_num_batched_tokens == 77
    assert llm.engine.runner.kv_cache.num_slots == 3 and llm.engine.backend.name == "reference"
    assert llm.config.dtype == "float32"  # auto on the CPU reference backend


def test_missing_model_dir_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        LLM(model=str(tmp_path / "nope"))


def test_lifecycle_hooks_are_called():
    calls: dict[str, list] = {"configure": [], "started": [], "stats": []}
    plugin = types.SimpleNamespace(
        deepinfer_configure=hookimpl(lambda config: calls["configure"].append(config)),
        deepinfer_engine_started=hookimpl(lambda engine: calls["started"].append(engine)),
        deepinfer_step_stats=hookimpl(lambda stats: calls["stats"].append(stats)),
    )
    reset_plugins()
    try:
        get_plugins().add_plugin(plugin, name="test-hooks")
        llm = LLM(backend="reference", max_num_seqs=5)
        llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))
    finally:
        reset_plugins()
    assert [c.max_num_seqs for c in calls["configure"]] == [5]
    assert calls["started"] == [llm.engine]
    assert len(calls["stats"]) == 3 and calls["stats"][0].num_tokens == len(
        llm.get_tokenizer().encode(PROMPTS[0])
    )
    assert [s.num_tokens for s in calls["stats"][1:]] == [1, 1]


# ---- abort -------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_abort_frees_the_cache_and_returns_tokens_so_far(solo, async_scheduling):
    llm = LLM(
        model=str(builtin_tiny_model_dir()),
        backend="reference",
        max_num_seqs=2,
        async_scheduling=async_scheduling,
    )
    engine, tok = llm.engine, llm.get_tokenizer()
    long = SamplingParams(temperature=0, max_tokens=6)
    for rid, prompt in zip("abc", PROMPTS[:3], strict=True):  # "c" waits: 2 slots
        engine.add_request(rid, tok.encode(prompt), long)
    outs = {}
    for _ in range(3):
        outs.update((o.request_id, o) for o in engine.step())
    assert not outs
    engine.abort_request(["b", "c", "no-such-id"])
    aborted = {o.request_id: o for o in engine.step()}
    assert set(aborted) == {"b", "c"}
    b, c = aborted["b"].outputs[0], aborted["c"].outputs[0]
    assert b.finish_reason == c.finish_reason == "abort" and aborted["b"].finished
    # its tokens so far, exactly as if run alone: three steps ran; with async scheduling the
    # third step's outputs were not processed yet when the abort arrived, so they are dropped
    assert b.token_ids == solo[1][: 2 if async_scheduling else 3]
    assert c.token_ids == []  # it never got a slot
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert set(outs) == {"a"} and outs["a"].outputs[0].token_ids == solo[0]
    kv = engine.runner.kv_cache
    assert kv.num_free_pages == kv.num_pages and kv.num_free_slots == kv.num_slots
    assert not engine.scheduler.has_unfinished()


def test_llm_abort_from_a_step_hook(solo):
    """The offline pattern: a callback (here the step-stats hook) aborts prompts mid-generate."""
    holder: dict[str, LLM] = {}

    def on_step(stats):
        if stats.step == 2:
            holder["llm"].abort("1")
        if stats.step == 4:
            holder["llm"].abort()  # everything still in flight

    reset_plugins()
    try:
        get_plugins().add_plugin(
            types.SimpleNamespace(deepinfer_step_stats=hookimpl(on_step)), name="test-abort"
        )
        holder["llm"] = llm = LLM(model=str(builtin_tiny_model_dir()), backend="reference")
        outs = llm.generate(
            [PROMPTS[0], PROMPTS[1], PROMPTS[2]],
            [SamplingParams(temperature=0, max_tokens=2), GREEDY, GREEDY],
            use_tqdm=False,
        )
    finally:
        reset_plugins()
    assert [o.request_id for o in outs] == ["0", "1", "2"]
    assert outs[0].outputs[0].finish_reason == "length" and outs[0].outputs[0].token_ids == solo[0][:2]
    assert outs[1].outputs[0].finish_reason == "abort" and outs[1].outputs[0].token_ids == solo[1][:2]
    assert outs[2].outputs[0].finish_reason == "abort" and outs[2].outputs[0].token_ids == solo[2][:4]
    again = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0]  # the engine is clean afterwards
    assert again.outputs[0].token_ids == solo[1]


# ---- progress bar ------------------------------------------------------------------------------
def test_progress_bar_shows_tokens_per_second_only_when_asked(llm, capsys):
    capsys.readouterr()
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""
    llm.generate(PROMPTS[:2], GREEDY)  # use_tqdm defaults to True, as in vLLM
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err and "tok/s" in err
    rate = float(err.rsplit("output ", 1)[1].split(" tok/s")[0])
    assert rate > 0
