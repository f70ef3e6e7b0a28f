"""The ``dspark`` drafter in the engine (DeepSeek-V4.1's DSpark block drafter).

* the drafter and the checkpoint must match: ``drafter="mtp"`` on V4.1 and ``drafter="dspark"``
  on V4 are one-line ``ConfigError``s naming the right drafter;
* losslessness: greedy and seeded outputs with ``speculative={"method": "dspark" | "fixed",
  "drafter": "dspark"}`` equal plain decoding token for token (a batch of requests; async
  scheduling stays on: the drafter observes nothing); ``rejection`` acceptance gets the
  drafts' distributions; decode / verify graphs (emulated) give the eager run's drafts; greedy
  drafts are picked by the engine's op table (a backend's ``argmax_rows``), as the verifier's tokens;
* usefulness: a checkpoint whose target is a bigram model (every block's output projections
  zeroed) and whose drafter's base logits are zero (final norm 0) with a Markov head equal to
  that bigram (rank = vocab) gets > 95 % of its drafts accepted, greedy and sampled (the drafts
  draw with the verifier's noise), and a large constant confidence gives ``c ≈ 1``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer_core.backends import BackendSpec
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.errors import ConfigError
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.llm import LLM
from deepinfer_core.models.deepseek_v41.tiny import make_tiny, tiny_config
from deepinfer_core.ops.sampling import argmax_rows
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.speculative.dspark import DSparkDrafter
from deepinfer_core.speculative.step_cost import StepCost
from deepinfer_core.testing.observe import record_replays
from tests.models.test_spec_rollback import _ids
from tests.models.v41.conftest import PLAIN_CHANGES, v41_llm, v41_plugins

PROMPTS = [{"prompt_token_ids": _ids(20 + i, n)} for i, n in enumerate((4, 13, 9))]
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=14, ignore_eos=True),
    # the drafts go through the request's own logit processing, as the verifier's rows
    "penalised": SamplingParams(
        temperature=0.8, seed=3, max_tokens=14, min_tokens=14, repetition_penalty=1.3, presence_penalty=0.5
    ),
}


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_drafter_must_match_the_checkpoints_draft_layers(v41_dspark_dir, tiny_dir):
    with pytest.raises(
        ConfigError, match=r"drafter='mtp' .*'deepseek_v41' has DSpark .*use drafter='dspark'$"
    ) as e:
        v41_llm(v41_dspark_dir, speculative={"drafter": "mtp"})
    assert "\n" not in str(e.value)
    from deepinfer_core import LLM

    with pytest.raises(
        ConfigError, match=r"drafter='dspark' .*'deepseek_v4' has an MTP layer .*use drafter='mtp'$"
    ):
        LLM(model=str(tiny_dir), speculative={"drafter": "dspark"})


@pytest.fixture(scope="module")
def plain(v41_dspark_dir) -> dict[str, list[list[int]]]:
    llm = v41_llm(v41_dspark_dir, max_num_seqs=4)
    return {k: _tokens(llm.generate(PROMPTS, p, use_tqdm=False)) for k, p in PARAMS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fixed", "dspark"])
@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_outputs_equal_plain_decoding(v41_dspark_dir, plain, kind, method):
    spec = {"method": method, "drafter": "dspark", "max_draft_tokens": 7}  # > γ: γ drafts
    llm = v41_llm(v41_dspark_dir, max_num_seqs=4, speculative=spec)
    assert llm.engine.config.async_scheduling and not llm.engine.spec.drafter_observes
    assert _tokens(llm.generate(PROMPTS, PARAMS[kind], use_tqdm=False)) == plain[kind]
    m = llm.get_metrics()["speculative"]
    assert m["num_proposed_tokens"] > 0, m
    assert not any(m["verify_length_histogram"][6:]), m  # at most γ = 5 drafts


@pytest.mark.slow
def test_greedy_drafts_take_the_backends_argmax_rows(v41_dspark_dir, plain):
    """Greedy drafts are picked by the engine's op table (``argmax_rows``), as the verifier's
    tokens: a backend's op that records its callers sees the drafter's walk and the sampler,
    and the outputs stay plain decoding's."""
    callers: list[str] = []

    def recording(x):
        callers.append(sys._getframe(1).f_code.co_name)
        return argmax_rows(x)

    class Plugin:
        @hookimpl
        def deepinfer_register_backends(self, register):
            register(BackendSpec(name="greedy_test", device_type="cpu", ops={"argmax_rows": recording}))

    manager = v41_plugins()
    manager.add_plugin(Plugin(), "greedy_test")
    spec = {"method": "fixed", "drafter": "dspark", "max_draft_tokens": 4}
    cfg = EngineConfig(
        model=str(v41_dspark_dir), backend="greedy_test", dtype="float32", max_num_seqs=4, speculative=spec
    )
    llm = LLM.from_engine(LLMEngine(cfg, plugins=manager))
    assert llm.engine.spec.drafter.sampler.ops is llm.engine.ops
    assert _tokens(llm.generate(PROMPTS, PARAMS["greedy"], use_tqdm=False)) == plain["greedy"]
    assert {"_walk_argmax", "sample"} <= set(callers), set(callers)


@pytest.mark.slow
def test_rejection_acceptance_gets_the_draft_distributions(v41_dspark_dir, monkeypatch):
    seen: list = []
    propose = DSparkDrafter.propose

    def record(self, contexts):
        drafts = propose(self, contexts)
        seen.extend(drafts)
        return drafts

    monkeypatch.setattr(DSparkDrafter, "propose", record)
    spec = {"method": "fixed", "drafter": "dspark", "acceptance": "rejection"}
    llm = v41_llm(v41_dspark_dir, max_num_seqs=4, speculative=spec)
    outs = llm.generate(PROMPTS, PARAMS["seeded"], use_tqdm=False)
    assert all(len(t) == 14 for t in _tokens(outs))
    assert seen and all(d.probs is not None and d.probs.shape == (len(d.token_ids), 512) for d in seen)
    for d in seen:  # each draft is a token its distribution gives mass
        assert all(float(d.probs[i, t]) > 0 for i, t in enumerate(d.token_ids))
        torch.testing.assert_close(d.probs.sum(-1), torch.ones(len(d.token_ids), dtype=d.probs.dtype))
    # method="dspark" schedules such drafts with Algorithm 1's early stop
    import deepinfer_core.speculative.verify_policy as policies

    calls: list[bool] = []
    lengths = policies.dspark_lengths
    monkeypatch.setattr(
        policies,
        "dspark_lengths",
        lambda *a, causal=False: calls.append(causal) or lengths(*a, causal=causal),
    )
    llm = v41_llm(v41_dspark_dir, max_num_seqs=4, speculative={**spec, "method": "dspark"})
    llm.generate(PROMPTS, PARAMS["seeded"], use_tqdm=False)
    assert calls and all(calls)


@pytest.mark.slow
def test_graph_replays_give_the_eager_drafts(v41_dspark_dir):
    """Decode and verify steps replayed from (emulated) graphs write the same context keys as
    eager steps (the write is part of the captured forward), and the block steps replayed from
    DSpark graphs (padded to their bucket) read them as the eager block does: same drafts and
    confidences, same outputs."""
    from deepinfer_core.engine.graphs import EmulatedGraph

    spec = {"method": "fixed", "drafter": "dspark", "max_draft_tokens": 4}

    def run(graphs: bool) -> tuple[list, list, list[str]]:
        llm = v41_llm(v41_dspark_dir, max_num_seqs=4, speculative=spec, batch_invariant=True)
        runner, drafter = llm.engine.runner, llm.engine.spec.drafter
        replays: list[str] = []
        if graphs:
            assert runner.capture_graphs(EmulatedGraph) is None
            assert runner.graph_manager.graphs("dspark"), "no DSpark block graph captured"
            record_replays(
                {f: runner.graph_manager.graphs(f) for f in ("decode", "verify", "dspark")},
                replays,
            )
        proposed: list = []
        propose = drafter.propose

        def record(contexts):
            drafts = propose(contexts)
            proposed.append([(d.token_ids, d.confidence) for d in drafts])
            return drafts

        drafter.propose = record
        return _tokens(llm.generate(PROMPTS, PARAMS["seeded"], use_tqdm=False)), proposed, replays

    eager, graphed = run(False), run(True)
    assert "verify" in graphed[2] and "dspark" in graphed[2]
    assert graphed[:2] == eager[:2]


# ---- usefulness --------------------------------------------------------------------------------
CONFIDENCE_LOGIT = 12.0  # sigmoid(12) = 0.999994


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every target block's output projections zeroed (attention ``wo_b``, routed and shared
    experts' ``w2``, Engram values): the streams carry the token embedding through (scaled), so
    the target's logits are a function of the current token alone, ``B[x] = head . (RMSNorm(e_x)
    g)``.  The drafter: final norm 0 (``U = 0``), Markov head ``W1 = I``, ``W2 = B^T`` (rank =
    vocab), confidence weight ``CONFIDENCE_LOGIT`` on the Markov embedding part."""
    out = make_tiny(
        tmp_path_factory.mktemp("dspark_bigram"),
        config=tiny_config(**PLAIN_CHANGES, dspark_markov_rank=512),
        dspark=True,
    )
    path = out / "model.safetensors"
    with safe_open(str(path), "pt") as st:
        t = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
    for name in t:
        if name.startswith("layers.") and name.endswith(
            ("attn.wo_b.weight", "w2.weight", "engram.wkv.weight")
        ):
            t[name] = torch.zeros_like(t[name])
    e = t["embed.weight"]
    normed = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-20) * t["norm.weight"]
    bigram = normed @ t["head.weight"].T  # [V (current), V (next)]
    v = bigram.shape[0]
    t["mtp.2.norm.weight"] = torch.zeros_like(t["mtp.2.norm.weight"])
    t["mtp.2.markov_head.embed.weight"] = torch.eye(v)
    t["mtp.2.markov_head.head.weight"] = bigram.T.contiguous()
    conf = torch.zeros_like(t["mtp.2.confidence_head.weight"])
    conf[0, -v:] = CONFIDENCE_LOGIT
    t["mtp.2.confidence_head.weight"] = conf
    save_file(t, str(path))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_right_drafts_are_accepted(bigram_dir, kind, monkeypatch):
    confidences: list = []
    propose = DSparkDrafter.propose

    def record(self, contexts):
        drafts = propose(self, contexts)
        confidences.extend(c for d in drafts for c in d.confidence)
        return drafts

    monkeypatch.setattr(DSparkDrafter, "propose", record)
    # a fixed cost curve on which verifying a draft costs 1 % of a step, and no overhead learned
    # from timed steps: DSpark's choice then depends on the confidences alone, not on the
    # machine's load while the test runs
    cheap = StepCost({(b, t): 1.0 + 0.01 * b * (t - 1) for b in (1, 4) for t in (1, 6)})
    monkeypatch.setattr("deepinfer_core.engine.speculative.profile_step_cost", lambda *a: cheap)
    monkeypatch.setattr(StepCost, "observe", lambda *a: None)
    monkeypatch.setattr(StepCost, "observe_plain", lambda *a: None)
    params = PARAMS[kind]
    ref = _tokens(v41_llm(bigram_dir, max_num_seqs=4).generate(PROMPTS, params, use_tqdm=False))
    for method in ("fixed", "dspark"):
        llm = v41_llm(bigram_dir, max_num_seqs=4, speculative={"method": method, "drafter": "dspark"})
        assert _tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == ref
        m = llm.get_metrics()["speculative"]
        assert m["acceptance_rate"] > 0.95, (method, m)
        hist = m["verify_length_histogram"]
        assert hist[5] > 0 and hist[5] >= sum(hist[1:5]), (method, m)  # c ≈ 1: dspark verifies all
    assert min(confidences) > 0.9999


@pytest.mark.slow
@pytest.mark.parametrize("which", ["default", "mixed"])
def test_with_the_prefill_tail_drafts_read_tail_rows_and_outputs_stay_lossless(
    v41_dspark_dir, v41_dspark_mixed_dir, which, monkeypatch
):
    """``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=16``: a prefill's decoder layers (7..9, the
    drafter's target layers) run on its last 16 rows only; the context is written for those
    rows (the block reads only the last ``W``); ``mixed``: target layer 5 runs on every row, its
    features are cut to the tail rows.  The drafts then come from the approximate
    tail, but speculative outputs equal plain decoding under the same setting."""
    from deepinfer_core.models.deepseek_v41.model import TAIL_ENV

    monkeypatch.setenv(TAIL_ENV, "16")  # the same tail with and without speculation
    model_dir = v41_dspark_dir if which == "default" else v41_dspark_mixed_dir
    prompts = [{"prompt_token_ids": _ids(30 + i, n)} for i, n in enumerate((40, 27))]
    params = PARAMS["greedy"]
    ref = _tokens(v41_llm(model_dir, max_num_seqs=2).generate(prompts, params, use_tqdm=False))
    llm = v41_llm(model_dir, max_num_seqs=2, speculative={"method": "fixed", "drafter": "dspark"})
    assert llm.engine.runner.model.tail_tokens(llm.engine.runner.num_spec_tokens) == 16
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == ref
    assert llm.get_metrics()["speculative"]["num_draft_tokens"] > 0


@pytest.mark.slow
def test_quantised_checkpoint_with_packed_draft_rings(tmp_path, monkeypatch):
    """The release's formats: MXFP8 / MXFP4 weights kept quantised, FP8 window records (head dim
    32: whole blocks).  With ``kv_cache_dtype="fp8"`` the draft rings are packed too; batch
    invariant, the drafts are bitwise those of the plain cache (same values), and outputs equal
    plain decoding."""
    path = make_tiny(tmp_path / "q", dspark=True, fp8_linear=True, fp4_experts=True)
    proposed: list = []
    propose = DSparkDrafter.propose

    def record(self, contexts):
        drafts = propose(self, contexts)
        proposed.append([(d.token_ids, d.confidence) for d in drafts])
        return drafts

    monkeypatch.setattr(DSparkDrafter, "propose", record)
    runs = {}
    for kv in ("auto", "fp8"):
        opts = {"kv_cache_dtype": kv, "batch_invariant": True, "keep_quantized": True, "max_num_seqs": 4}
        ref = _tokens(v41_llm(path, **opts).generate(PROMPTS, PARAMS["seeded"], use_tqdm=False))
        proposed.clear()
        llm = v41_llm(path, speculative={"method": "fixed", "drafter": "dspark"}, **opts)
        assert _tokens(llm.generate(PROMPTS, PARAMS["seeded"], use_tqdm=False)) == ref
        packed = llm.engine.runner.cache.get(10, "window")
        assert (kv == "fp8") == (type(packed).__name__ == "BlockScaledKVPool")
        runs[kv] = list(proposed)
    assert runs["auto"] == runs["fp8"] and runs["auto"]


@pytest.mark.slow
def test_plain_greedy_walk_on_the_device_equals_the_sampler_walk(v41_dspark_dir, monkeypatch):
    """Greedy requests without penalties, masks, bias or bans walk the Markov head by argmax on
    the device (one read-back); the drafts and confidences are those of the walk through the
    engine's sampler, and the request's outputs plain decoding's."""
    from deepinfer_core.sampling.batch import SamplingTensors

    spec = {"method": "fixed", "drafter": "dspark", "max_draft_tokens": 4}

    def run(device_walk: bool) -> tuple[list, list, int]:
        llm = v41_llm(v41_dspark_dir, max_num_seqs=4, speculative=spec, batch_invariant=True)
        drafter = llm.engine.spec.drafter
        proposed, walks = [], {"argmax": 0}
        propose, walk = drafter.propose, drafter._walk_argmax

        def counted(*a):
            walks["argmax"] += 1
            return walk(*a)

        def record(contexts):
            drafts = propose(contexts)
            proposed.append([(d.token_ids, d.confidence) for d in drafts])
            return drafts

        drafter.propose, drafter._walk_argmax = record, counted
        with monkeypatch.context() as m:
            if not device_walk:
                m.setattr(SamplingTensors, "plain_greedy", property(lambda self: False))
            outs = llm.generate(PROMPTS, PARAMS["greedy"], use_tqdm=False)
        return _tokens(outs), proposed, walks["argmax"]

    device, sampler = run(True), run(False)
    assert device[2] > 0 and sampler[2] == 0
    assert device[:2] == sampler[:2]
    plain = v41_llm(v41_dspark_dir, max_num_seqs=4, batch_invariant=True)
    assert device[0] == _tokens(plain.generate(PROMPTS, PARAMS["greedy"], use_tqdm=False))
