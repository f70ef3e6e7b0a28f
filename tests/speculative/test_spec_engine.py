"""Speculative decoding in the engine, lossless: a third-party test plugin registers an
*oracle* drafter that proposes the tokens plain decoding produced (some deliberately wrong),
so verify steps accept, reject and roll back; every output equals the non-speculative run
token for token (greedy and seeded sampling, penalties, logprobs, stop strings, ``n > 1``,
prefix caching, preemption, structured outputs, batch invariance bitwise)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.errors import ConfigError
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugins import PluginManager
from deepinfer_core.speculative import Draft, Drafter
from deepinfer_core.speculative.step_cost import StepCost
from deepinfer_core.testing.managers import manager_with_plugin

PROMPTS = [
    [5, 9, 23, 7, 7, 41, 3],
    [88, 12, 4],
    [17] * 11,
    [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72],
]


class OracleDrafter(Drafter):
    """Proposes the reference continuation (``script``: prompt -> tokens of plain decoding),
    with every third proposal's ``(len(output) % 3)``-th token wrong, so acceptance lengths
    vary from 0 to the whole draft."""

    script: dict[tuple[int, ...], list[int]] = {}
    calls = 0

    def propose(self, contexts):
        OracleDrafter.calls += 1
        drafts = []
        for c in contexts:
            prompt = tuple(c.token_ids[: c.num_prompt_tokens])
            out = list(c.token_ids[c.num_prompt_tokens :])
            ref = self.script.get(prompt, [])
            tokens = []
            if ref[: len(out)] == out:
                tokens = list(ref[len(out) : len(out) + c.max_tokens])
            if tokens and len(out) % 3 == 0:
                j = len(out) % len(tokens)
                tokens[j] = (tokens[j] + 1) % self.vocab_size
            drafts.append(Draft(tokens))
        return drafts


class WrongDrafter(OracleDrafter):
    """Proposes the reference continuation with every token shifted by one: never accepted."""

    calls = 0

    def propose(self, contexts):
        WrongDrafter.calls += 1
        drafts = super().propose(contexts)
        return [Draft([(t + 1) % self.vocab_size for t in d.token_ids] or [0]) for d in drafts]


class SureDrafter(OracleDrafter):
    """The oracle's drafts, each claimed certain (confidence 1 at every position)."""

    def propose(self, contexts):
        return [Draft(d.token_ids, confidence=[1.0] * len(d.token_ids)) for d in super().propose(contexts)]


class Plugin:
    @hookimpl
    def deepinfer_register_drafters(self, register):
        register("oracle", lambda: OracleDrafter, description="test oracle")
        register("sure", lambda: SureDrafter, description="test oracle claiming certainty")
        register("wrong", lambda: WrongDrafter, description="test drafter that is never right")
        register("broken", lambda: OracleDrafter, is_available=lambda: (False, "needs a unicorn"))


def _llm(tiny_dir: Path, speculative=None, **kw) -> LLM:
    if kw.get("backend", "reference") == "reference":
        manager = manager_with_plugin(Plugin(), "spec_test")
    else:  # the installed backend plugins too
        manager = PluginManager()
        manager.load_entry_points(allow="")
        manager.add_plugin(Plugin(), "spec_test")
    config = EngineConfig(model=str(tiny_dir), max_num_seqs=8, speculative=speculative, **kw)
    llm = LLM.from_engine(LLMEngine(config, plugins=manager))
    if llm.engine.spec is not None and llm.engine.spec.cost is not None:
        # DSpark weighs drafts against step times measured at start; on a busy machine those
        # are noise, so the tests fix them: a verified token costs 5 % of a step
        llm.engine.spec.cost = StepCost({(b, t): 1.0 + 0.05 * b * (t - 1) for b in (1, 8) for t in (1, 6)})
    return llm


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _script(prompts, outs):
    OracleDrafter.script = {
        tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)
    }


PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11, max_tokens=24, ignore_eos=True),
    "penalties": SamplingParams(
        temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
        presence_penalty=0.5, frequency_penalty=0.4, min_tokens=20,
    ),
    "logprobs": SamplingParams(temperature=0.7, seed=5, max_tokens=20, ignore_eos=True, logprobs=3),
}  # fmt: skip


@pytest.mark.parametrize("method", ["fixed", "dspark", "dspark-sync"])
@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_outputs_equal_plain_decoding(tiny_dir, kind, method):
    """``dspark`` with async scheduling (steps without drafts overlap: measured faster than the
    fixed step costs, so it drafts mostly at probes) and without (drafts weighed every step)."""
    params = PARAMS[kind]
    ref = _llm(tiny_dir).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    _script(PROMPTS, ref)
    spec = _llm(
        tiny_dir,
        {"drafter": "oracle", "method": method.removesuffix("-sync"), "max_draft_tokens": 4},
        async_scheduling=not method.endswith("-sync"),
    )
    outs = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert _tokens(outs) == _tokens(ref)
    if params.logprobs is not None:
        for a, b in zip(outs, ref, strict=True):
            for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert la.keys() == lb.keys()
                assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)
    m = spec.get_metrics()["speculative"]
    assert m["num_accepted_tokens"] > 0, m  # drafts were accepted ...
    assert m["num_accepted_tokens"] < m["num_draft_tokens"], m  # ... and some rejected
    assert m["mean_acceptance_length"] > 1.0
    assert spec.get_metrics()["num_generated_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs)


def test_step_stats_count_drafts(tiny_dir):
    """The ``deepinfer_step_stats`` hook sees each step's verified and accepted draft tokens; their
    totals are the speculative metrics'."""
    params = PARAMS["greedy"]
    ref = _llm(tiny_dir).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    _script(PROMPTS, ref)
    seen = []

    class Stats:
        @hookimpl
        def deepinfer_step_stats(self, stats):
            seen.append(stats)

    manager = manager_with_plugin(Plugin(), "spec_test")
    manager.add_plugin(Stats(), "stats_test")
    config = EngineConfig(
        model=str(tiny_dir), max_num_seqs=8, speculative={"drafter": "oracle", "method": "fixed"}
    )
    llm = LLM.from_engine(LLMEngine(config, plugins=manager))
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    m = llm.get_metrics()["speculative"]
    assert sum(s.num_draft_tokens for s in seen) == m["num_draft_tokens"] > 0
    assert sum(s.num_accepted_tokens for s in seen) == m["num_accepted_tokens"] > 0


def test_fewer_target_forwards_with_good_drafts(tiny_dir):
    params = PARAMS["greedy"]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    base = _llm(tiny_dir)
    ref = base.generate(prompts, params)
    _script(PROMPTS, ref)
    spec = _llm(tiny_dir, {"drafter": "oracle", "method": "fixed", "max_draft_tokens": 4})
    spec.generate(prompts, params)
    assert spec.get_metrics()["num_steps"] < base.get_metrics()["num_steps"]


@pytest.mark.slow
def test_dspark_stops_asking_a_drafter_that_never_pays(tiny_dir):
    """With drafts that are never accepted, DSpark stops calling the drafter (a probe every
    PROBE_INTERVAL steps), while ``fixed`` calls it every step; outputs stay those of plain
    decoding."""
    from deepinfer_core.speculative.policy import PROBE_INTERVAL

    params = PARAMS["greedy"]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _llm(tiny_dir).generate(prompts, params)
    _script(PROMPTS, ref)
    calls = {}
    for method in ("fixed", "dspark"):
        WrongDrafter.calls = 0
        spec = _llm(tiny_dir, {"drafter": "wrong", "method": method, "max_draft_tokens": 4})
        assert _tokens(spec.generate(prompts, params)) == _tokens(ref)
        calls[method] = WrongDrafter.calls
        m = spec.get_metrics()["speculative"]
        assert m["num_accepted_tokens"] == 0, m
    assert m["num_steps_without_drafting"] > 0, m
    decode_steps = params.max_tokens - 2  # decode steps with room for a draft
    assert calls["fixed"] == decode_steps
    assert calls["dspark"] <= decode_steps // 2 + decode_steps // PROBE_INTERVAL, calls


@pytest.mark.slow
def test_dspark_probes_verify_every_draft(tiny_dir, monkeypatch):
    """Where DSpark's estimates say drafting does not pay, its probes still verify every draft
    proposed (verifying only what the estimates favour would verify nothing and never learn
    that the drafts are right); ``get_metrics`` shows the cost model it decided with."""
    import deepinfer_core.engine.speculative as engine_spec
    import deepinfer_core.speculative.verify_policy as policies

    weighed, decided = [], []
    # pessimistic; each weighing noted with the number of decisions taken before it
    monkeypatch.setattr(engine_spec, "drafting_gain", lambda *a: weighed.append(len(decided) - 1) or 0.0)
    decide = engine_spec.SpeculativeDecoder._drafting_pays
    monkeypatch.setattr(
        engine_spec.SpeculativeDecoder, "_drafting_pays", lambda *a: decided.append(1) or decide(*a)
    )
    monkeypatch.setattr(policies, "dspark_lengths", lambda confidences, *a: [0] * len(confidences))
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)  # long enough to back off
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _llm(tiny_dir).generate(prompts, params)
    _script(PROMPTS, ref)
    spec = _llm(tiny_dir, {"drafter": "oracle", "method": "dspark", "max_draft_tokens": 4})
    assert _tokens(spec.generate(prompts, params)) == _tokens(ref)
    m = spec.get_metrics()["speculative"]
    assert m["num_steps_without_drafting"] > 0, m
    assert m["num_accepted_tokens"] > 0, m  # the probes verified (and accepted) drafts
    assert sum(m["verify_length_histogram"][1:]) == m["num_drafts"] > 0, m
    cm = m["cost_model"]
    assert "1x1" in cm["forward_ms"] and cm["draft_ms"] >= 0, cm
    assert len(cm["acceptance_estimate"]) == 4 and cm["acceptance_estimate"][0] > 0.5, cm
    # a clear decision (gain 0) is reused for SETTLED_STEPS steps before it is weighed again,
    # and while each weighing confirms it, for twice as many as the last time (up to a cap)
    gaps = [b - a - 1 for a, b in itertools.pairwise(weighed)]
    settled, cap = engine_spec.SETTLED_STEPS, engine_spec.MAX_REUSE_STEPS
    assert len(gaps) >= 2, (weighed, len(decided))
    assert gaps == [min(settled * 2**i, cap) for i in range(len(gaps))], (gaps, weighed)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["wrong", "mtp"])
def test_steps_without_drafts_run_asynchronously(tiny_dir, drafter):
    """With async scheduling on, a step that verifies no draft is launched before the previous
    step's outputs are processed, as in plain decoding; one that drafts processes them first
    (its drafts need them) and runs synchronously.  DSpark with a drafter that never pays
    (here the random-weight MTP layer too, which follows every step from the hidden rows kept
    with it) thus runs mostly asynchronously, and the seeded tokens equal plain decoding's."""
    params = PARAMS["seeded"]
    ref = _llm(tiny_dir).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    _script(PROMPTS, ref)
    llm = _llm(tiny_dir, {"drafter": drafter, "method": "dspark", "max_draft_tokens": 4})
    engine = llm.engine
    assert engine.config.async_scheduling
    observed = []
    observe = engine.spec.drafter.observe
    engine.spec.drafter.observe = lambda chunks: observed.append(len(chunks)) or observe(chunks)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    outs, overlapped, drafted = {}, 0, 0
    while engine.has_unfinished():
        verified_before = llm.get_metrics()["speculative"]["num_draft_tokens"]
        outs.update((o.request_id, o) for o in engine.step())
        if llm.get_metrics()["speculative"]["num_draft_tokens"] > verified_before:
            drafted += 1
            assert engine._inflight is None  # a verify step: processed before returning
        overlapped += engine._inflight is not None
    if drafter == "mtp":  # the random MTP's confidences are low: DSpark never drafts with it
        assert overlapped > 10 and len(observed) >= overlapped, (overlapped, observed)
    else:
        assert drafted > 0 and overlapped > 2 * drafted, (drafted, overlapped)
    assert [outs[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == [
        o.outputs[0].token_ids for o in ref
    ]


@pytest.mark.slow
def test_stop_strings_n_and_prefix_caching(tiny_dir):
    """Stop strings cut inside an accepted run, ``n > 1`` samples, and a prefix-cache hit on a
    prompt that shares pages with an earlier request's rolled-back verify steps."""
    shared = [3 + (i * 7) % 50 for i in range(40)]
    prompts = [shared + [1, 2], shared + [9]]
    base = _llm(tiny_dir)
    probe = base.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=16))
    stop = probe[0].outputs[0].text[4:7] or None
    params = SamplingParams(temperature=0.8, seed=2, n=2, max_tokens=16, stop=[stop] if stop else None)
    ref = base.generate([{"prompt_token_ids": p} for p in prompts], params)
    _script(prompts, ref)
    spec = _llm(tiny_dir, {"drafter": "oracle", "max_draft_tokens": 3})
    outs = []
    for p in prompts:  # one after the other: the second hits the first's cached pages
        outs += spec.generate([{"prompt_token_ids": p}], params)
    assert _tokens(outs) == _tokens(ref)
    assert [[c.text for c in o.outputs] for o in outs] == [[c.text for c in o.outputs] for o in ref]
    assert spec.get_metrics()["num_prefix_hit_tokens"] > 0


@pytest.mark.slow
def test_preemption(tiny_dir):
    """A cache too small for every request: preempted requests resume and still match."""
    params = SamplingParams(temperature=0.6, seed=4, max_tokens=30, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _llm(tiny_dir, num_cache_pages=6).generate(prompts, params)
    _script(PROMPTS, ref)
    spec = _llm(tiny_dir, {"drafter": "oracle", "max_draft_tokens": 4}, num_cache_pages=6)
    outs = spec.generate(prompts, params)
    assert _tokens(outs) == _tokens(ref)
    assert spec.get_metrics()["num_preemptions"] > 0


@pytest.mark.slow
def test_batch_invariant_bitwise(tiny_dir):
    """With ``batch_invariant=True`` the logprobs are bitwise those of plain decoding."""
    params = SamplingParams(temperature=0.9, seed=8, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _llm(tiny_dir, batch_invariant=True).generate(prompts, params)
    _script(PROMPTS, ref)
    outs = _llm(tiny_dir, {"drafter": "oracle", "max_draft_tokens": 4}, batch_invariant=True).generate(
        prompts, params
    )
    assert _tokens(outs) == _tokens(ref)
    assert [o.outputs[0].logprobs for o in outs] == [o.outputs[0].logprobs for o in ref]


@pytest.mark.slow
def test_ngram_drafter_is_lossless(tiny_dir):
    """The core's n-gram drafter; a negative presence penalty makes the random model repeat."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=-2.0)
    prompts = [{"prompt_token_ids": [4, 5, 6, 7] * 6}, {"prompt_token_ids": [9, 9, 9, 9, 9]}]
    ref = _llm(tiny_dir).generate(prompts, params)
    spec = _llm(tiny_dir, {"drafter": "ngram", "max_draft_tokens": 5})
    assert _tokens(spec.generate(prompts, params)) == _tokens(ref)
    assert spec.get_metrics()["speculative"]["num_draft_tokens"] > 0


def test_drafter_errors_name_the_drafter(tiny_dir):
    with pytest.raises(ConfigError, match="'nope' is not registered.*oracle"):
        _llm(tiny_dir, {"drafter": "nope"})
    with pytest.raises(ConfigError, match="'broken' is unavailable: needs a unicorn"):
        _llm(tiny_dir, {"drafter": "broken"})


@pytest.mark.slow
def test_verify_steps_replay_graphs_bitwise(tiny_dir):
    """Verify steps of ``1 + max_draft_tokens`` tokens per request run through the captured
    (here emulated) verify graphs, padded to the bucket, with results bitwise equal to plain
    eager decoding in batch-invariant mode."""
    from deepinfer_core.engine.graphs import EmulatedGraph

    params = SamplingParams(temperature=0.8, seed=6, max_tokens=20, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    ref = _llm(tiny_dir, batch_invariant=True, enforce_eager=True).generate(prompts, params)
    _script(PROMPTS[:3], ref)
    spec = _llm(
        tiny_dir, {"drafter": "oracle", "max_draft_tokens": 3}, batch_invariant=True, enforce_eager=True
    )
    runner = spec.engine.runner
    assert runner.capture_graphs(EmulatedGraph) is None
    assert sorted(runner.graph_manager.graphs("verify")) == [1, 2, 4, 8]
    replays: list[int] = []
    for b, graph in runner.graph_manager.graphs("verify").items():
        inner = graph.replay
        graph.replay = lambda inner=inner, b=b: replays.append(b) or inner()
    outs = spec.generate(prompts, params)
    assert replays and set(replays) <= {1, 2, 4}
    assert _tokens(outs) == _tokens(ref)
    assert [o.outputs[0].logprobs for o in outs] == [o.outputs[0].logprobs for o in ref]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_verify_graphs_equal_plain_decoding_bitwise(tiny_dir, dtype):
    """On the GPU (``cuda_sm100``, real CUDA graphs, batch invariant): verify steps replay the
    captured verify graphs and every request's tokens and logprobs are bitwise those of plain
    decoding with decode graphs."""
    params = SamplingParams(temperature=0.9, seed=6, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    kw = {"backend": "cuda_sm100", "device": "cuda", "dtype": dtype, "batch_invariant": True}
    ref = _llm(tiny_dir, **kw).generate(prompts, params)
    _script(PROMPTS, ref)
    spec = _llm(tiny_dir, {"drafter": "oracle", "max_draft_tokens": 4}, **kw)
    runner = spec.engine.runner
    assert runner.graph_manager.graphs("decode") and runner.graph_manager.graphs("verify"), (
        "CUDA graphs were not captured"
    )
    replays: list[int] = []
    for b, graph in runner.graph_manager.graphs("verify").items():
        inner = graph.replay
        graph.replay = lambda inner=inner, b=b: replays.append(b) or inner()
    outs = spec.generate(prompts, params)
    assert replays, "no verify step replayed a CUDA graph"
    assert _tokens(outs) == _tokens(ref)
    assert [o.outputs[0].logprobs for o in outs] == [o.outputs[0].logprobs for o in ref]
    m = spec.get_metrics()["speculative"]
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]


def test_dspark_calibrates_a_drafters_confidence_online(tiny_dir):
    """A drafter that claims certainty while a third of its proposals carry a wrong token:
    DSpark's calibration of its confidences falls below 1 where drafts fail, and the outputs
    stay plain decoding's."""
    params = PARAMS["greedy"]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _llm(tiny_dir).generate(prompts, params)
    _script(PROMPTS, ref)
    spec = _llm(
        tiny_dir, {"drafter": "sure", "method": "dspark", "max_draft_tokens": 4}, async_scheduling=False
    )
    assert _tokens(spec.generate(prompts, params)) == _tokens(ref)
    m = spec.get_metrics()["speculative"]
    ratios = m["cost_model"]["confidence_calibration"]
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"], m
    assert min(ratios) < 0.95 and all(0 < r <= 1.0 + 1e-9 for r in ratios), ratios


def test_dspark_without_varlen_verifies_one_length_per_step(tiny_dir, monkeypatch):
    """``speculative.varlen=False``: every verify step gives its requests one length (each
    verifies ``min(L, its drafts)``), and the outputs stay plain decoding's."""
    import deepinfer_core.speculative.verify_policy as policies

    chosen = []
    uniform = policies.uniform_lengths

    def record(confidences, budget, cost, causal=False):
        lengths = uniform(confidences, budget, cost, causal)
        chosen.append(([len(c) for c in confidences], lengths))
        return lengths

    monkeypatch.setattr(policies, "uniform_lengths", record)
    params = PARAMS["seeded"]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _llm(tiny_dir).generate(prompts, params)
    _script(PROMPTS, ref)
    spec = _llm(tiny_dir, {"drafter": "oracle", "method": "dspark", "max_draft_tokens": 4, "varlen": False})
    assert _tokens(spec.generate(prompts, params)) == _tokens(ref)
    assert any(sum(lengths) for _, lengths in chosen), chosen
    for proposed, lengths in chosen:
        top = max(lengths, default=0)
        assert lengths == [min(top, n) for n in proposed], (proposed, lengths)
    assert spec.get_metrics()["speculative"]["num_accepted_tokens"] > 0
