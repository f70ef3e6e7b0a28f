"""The DSpark block drafter of DeepSeek-V4.1 (``mtp.*``): config, loading, and the engine's
drafts against the independent oracle (:mod:`tests.models.v41.dspark_oracle`).

* config: the ``dspark_*`` fields are checked when the drafter loads (one-line ``ConfigError``);
* loading: both spellings of the confidence head, head/combiner tensors under any stage but
  exactly once, quantised tensors kept as the main loader keeps them, a checkpoint without the
  drafter (or one of its tensors) is a one-line ``ConfigError`` naming the tensor;
* the engine's drafts, confidences, base logits ``U`` and collapsed hidden ``y`` equal the
  oracle's at every decode step of greedy runs (float32, ``v41_dspark_dir``): anchors before and
  after the window fills, after chunked prefill, after a prefix-cache hit (the replay rebuilt
  the draft rings);
* the draft rings after verify steps with rejected drafts equal those of a run of the accepted
  tokens only, bitwise (the fused context write uses the target's ring plan).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer_core.config import EngineConfig, SpeculativeConfig
from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.errors import ConfigError, WeightLoadError
from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config
from deepinfer_core.models.deepseek_v41.tiny import make_tiny, tiny_config
from deepinfer_core.models.deepseek_v41.weights import load_dspark_weights
from deepinfer_core.ops import OpTable
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.speculative.dspark import DSparkDrafter
from deepinfer_core.speculative.dspark_layers import DSparkLayers
from deepinfer_core.weights.quant import QuantizedTensor
from tests.models.test_spec_rollback import _ids, _prefill, run_pair
from tests.models.v41.conftest import v41_llm
from tests.models.v41.dspark_oracle import DSparkOracle

U_ATOL = 1e-4  # float32: engine and oracle differ in summation order only


# ---- config ------------------------------------------------------------------------------------
def _cfg(**changes) -> DeepseekV41Config:
    from deepinfer_core.models.deepseek_v41.tiny import TINY_DSPARK_CHANGES

    return DeepseekV41Config.from_dict(tiny_config(**{**TINY_DSPARK_CHANGES, **changes}), source="t.json")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"dspark_noise_token_id": 512}, "dspark_noise_token_id"),
        ({"dspark_noise_token_id": -1}, "dspark_noise_token_id"),
        ({"dspark_target_layer_ids": [9, 8]}, "dspark_target_layer_ids"),
        ({"dspark_target_layer_ids": [8, 8]}, "dspark_target_layer_ids"),
        ({"dspark_target_layer_ids": [9, 11]}, "dspark_target_layer_ids"),
        ({"dspark_block_size": 0}, "dspark_block_size"),
        ({"dspark_markov_rank": 0}, "dspark_markov_rank"),
        ({"dspark_num_experts_per_tok": 5}, "dspark_num_experts_per_tok"),
        ({"num_nextn_predict_layers": 0, "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1]}, "num_nextn"),
    ],
)
def test_dspark_fields_are_checked_when_the_drafter_loads(changes, field):
    cfg = _cfg(**changes)  # parses: a config without a usable drafter is still a valid model
    with pytest.raises(ConfigError, match=rf"^t\.json: DSpark drafter: {field}") as e:
        cfg.check_dspark("t.json")
    assert "\n" not in str(e.value)


def test_dspark_defaults():
    cfg = _cfg()
    assert cfg.dspark_target_layer_ids == [7, 8, 9] and cfg.dspark_num_layers == 3
    cfg.check_dspark()
    _cfg(dspark_target_layer_ids=[0, 10]).check_dspark()  # id L: the last layer's output streams
    assert cfg.compress_ratio(10) == 0 and cfg.draft_compress_ratios == [0, 0, 0]


# ---- loading -----------------------------------------------------------------------------------
def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as st:
        return {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with its tensors passed through ``edit``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(edit(_tensors(src)), str(dst / "model.safetensors"))
    return dst


def _load(model_dir: Path, **kw):
    cfg = DeepseekV41Config.from_dict(json.loads((model_dir / "config.json").read_text()))
    return load_dspark_weights(model_dir, cfg, torch.float32, **kw)


def test_confidence_head_names_and_stages_are_both_accepted(v41_dspark_dir, tmp_path):
    want = _load(v41_dspark_dir)
    assert want["mtp.2.confidence_head.weight"].shape == (1, 64 + 16)

    def moved(t: dict) -> dict:  # vLLM-nvidia's module path, head tensors under stage 0, combiner under 1
        t = dict(t)
        t["mtp.2.confidence_head.proj.weight"] = t.pop("mtp.2.confidence_head.weight")
        t["mtp.0.markov_head.head.weight"] = t.pop("mtp.2.markov_head.head.weight")
        t["model.mtp.1.main_proj.weight"] = t.pop("mtp.0.main_proj.weight")
        return t

    got = _load(_rewrite(v41_dspark_dir, tmp_path / "moved", moved))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_stages_image_token_router_biases_are_skipped(v41_dspark_dir, tmp_path):
    """The release's draft stages carry ``mtp.{j}.ffn.gate.bias_vl`` as its main layers carry
    ``gate.bias_vl``: the drafter loads without them, as the text model does."""
    want = _load(v41_dspark_dir)

    def with_vl(t: dict) -> dict:
        biases = {k + "_vl": torch.randn(v.shape) for k, v in t.items() if k.endswith("ffn.gate.bias")}
        assert len([k for k in biases if k.startswith("mtp.")]) == 3
        return {**t, **biases}

    got = _load(_rewrite(v41_dspark_dir, tmp_path / "vl", with_vl))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_two_copies_of_a_head_tensor_are_refused(v41_dspark_dir, tmp_path):
    def twice(t: dict) -> dict:
        return {**t, "mtp.2.confidence_head.proj.weight": t["mtp.2.confidence_head.weight"].clone()}

    with pytest.raises(WeightLoadError, match="both provide 'mtp.2.confidence_head.weight'"):
        _load(_rewrite(v41_dspark_dir, tmp_path / "twice", twice))


def test_a_missing_tensor_is_named(v41_dspark_dir, v41_plain_dir, tmp_path):
    def drop(t: dict) -> dict:
        return {k: v for k, v in t.items() if k != "mtp.1.attn.wkv.weight"}

    with pytest.raises(ConfigError, match=r"lacks mtp\.1\.attn\.wkv\.weight$"):
        _load(_rewrite(v41_dspark_dir, tmp_path / "drop", drop))
    # the default tiny checkpoint has no drafter: the engine says so in one line
    with pytest.raises(
        ConfigError, match=r"drafter='dspark' needs the DSpark draft layers, but .* has no mtp\.\* tensor"
    ) as e:
        v41_llm(v41_plain_dir, speculative={"drafter": "dspark"})
    assert "\n" not in str(e.value)


def test_without_the_confidence_head_drafts_carry_no_confidence(v41_dspark_dir, tmp_path):
    def drop(t: dict) -> dict:
        return {k: v for k, v in t.items() if "confidence" not in k}

    path = _rewrite(v41_dspark_dir, tmp_path / "noconf", drop)
    assert "mtp.2.confidence_head.weight" not in _load(path)
    runner = _runner(path, 4)
    assert runner.model.dspark.confidence(torch.zeros(1, 64), torch.zeros(1, 16)) is None


def test_quantised_drafter_tensors_are_kept_as_the_main_loader_keeps_them(tmp_path):
    path = make_tiny(tmp_path / "q", fp8_linear=True, fp4_experts=True, dspark=True)
    w = _load(path, keep_quantized=True)
    assert isinstance(w["mtp.1.attn.wq_a.weight"], QuantizedTensor)
    assert isinstance(w["mtp.2.ffn.experts.gate_up"], QuantizedTensor)
    assert w["mtp.0.main_proj.weight"].dtype == torch.float32  # BF16-kind: stored unquantised
    assert w["mtp.2.markov_head.head.weight"].dtype == torch.float32
    plain = _load(path)
    assert torch.equal(w["mtp.1.attn.wq_a.weight"].dequantize(torch.float32), plain["mtp.1.attn.wq_a.weight"])


# ---- the engine against the oracle -------------------------------------------------------------
@pytest.fixture
def recorded(monkeypatch):
    """Every ``(token ids, Draft, U [γ, V], y [γ, D])`` the ``dspark`` drafter proposes."""
    out: list = []
    propose = DSparkDrafter.propose

    def recording(self, contexts):
        blocks: list = []
        execute = self.layers.execute

        def run(chunks):
            u, y = execute(chunks)
            blocks.append((u, y))
            return u, y

        self.layers.execute = run
        try:
            drafts = propose(self, contexts)
        finally:
            del self.layers.execute
        [(u, y)] = blocks
        g = self.head.block_size
        for i, (c, d) in enumerate(zip(contexts, drafts, strict=True)):
            out.append((list(c.token_ids), d, u[i * g : (i + 1) * g], y[i * g : (i + 1) * g]))
        return drafts

    monkeypatch.setattr(DSparkDrafter, "propose", recording)
    return out


def _assert_oracle(model_dir: Path, records: list, anchors: tuple[int, int] | None = None) -> None:
    oracle = DSparkOracle(model_dir)
    assert records
    for ids, draft, u, y in records:
        want = oracle.draft(ids, len(draft.token_ids))
        where = f"anchor at {len(ids) - 1}"
        assert draft.token_ids == want["tokens"].tolist(), where
        torch.testing.assert_close(u, want["U"], atol=U_ATOL, rtol=0, msg=where)
        torch.testing.assert_close(y, want["y"], atol=U_ATOL, rtol=1e-4, msg=where)
        conf = torch.tensor(draft.confidence)
        torch.testing.assert_close(conf, want["confidence"], atol=1e-5, rtol=0, msg=where)
    if anchors is not None:
        lo, hi = anchors
        ps = {len(ids) - 1 for ids, *_ in records}
        assert min(ps) <= lo and max(ps) >= hi, sorted(ps)


SPEC = {"method": "fixed", "drafter": "dspark", "max_draft_tokens": 5}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.mark.slow
def test_drafts_match_the_oracle_at_every_decode_step(v41_dspark_dir, recorded):
    """Two requests batched: anchors from before the window fills (P < W = 8) to past it."""
    llm = v41_llm(v41_dspark_dir, speculative=SPEC, max_num_seqs=2)
    prompts = [{"prompt_token_ids": _ids(1, 3)}, {"prompt_token_ids": _ids(2, 11)}]
    llm.generate(prompts, GREEDY, use_tqdm=False)
    _assert_oracle(v41_dspark_dir, recorded, anchors=(4, 14))
    # the comparison tells the window readings of design note §5 Q1 apart
    ids, _, u, _ = max(recorded, key=lambda r: len(r[0]))
    causal, _ = DSparkOracle(v41_dspark_dir, window="causal").block(ids)
    assert (causal - u).abs().max() > 1e-2


@pytest.mark.slow
def test_drafts_match_the_oracle_with_target_layers_before_the_decoder_and_at_l(
    v41_dspark_mixed_dir, recorded
):
    llm = v41_llm(v41_dspark_mixed_dir, speculative=SPEC, max_num_seqs=2)
    llm.generate(
        [{"prompt_token_ids": _ids(1, 3)}, {"prompt_token_ids": _ids(2, 11)}], GREEDY, use_tqdm=False
    )
    _assert_oracle(v41_dspark_mixed_dir, recorded)


@pytest.mark.slow
def test_drafts_match_the_oracle_after_chunked_prefill(v41_dspark_dir, recorded):
    llm = v41_llm(v41_dspark_dir, speculative=SPEC, max_num_seqs=2, max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": _ids(3, 37)}, {"prompt_token_ids": _ids(4, 23)}]
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.get_metrics()["num_preemptions"] == 0
    _assert_oracle(v41_dspark_dir, recorded)


@pytest.mark.slow
def test_drafts_match_the_oracle_after_a_prefix_cache_hit(v41_dspark_dir, recorded):
    """The replay before the hit (from ``window_from > 0``) rebuilds the draft rings."""
    llm = v41_llm(v41_dspark_dir, speculative=SPEC, max_num_seqs=1, enable_prefix_caching=True)
    first = _ids(5, 130)
    llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)
    recorded.clear()
    llm.generate([{"prompt_token_ids": first[:120] + _ids(6, 7)}], GREEDY, use_tqdm=False)
    assert llm.get_metrics()["num_prefix_hit_tokens"] >= 112
    assert llm.engine.runner.replay_tail < 112  # so the replay starts after position 0
    _assert_oracle(v41_dspark_dir, recorded)


# ---- rollback ----------------------------------------------------------------------------------
def _runner(path: Path, num_spec_tokens: int) -> ModelRunner:
    cfg = EngineConfig(
        model=str(path),
        dtype="float32",
        max_num_seqs=3,
        max_model_len=160,
        batch_invariant=True,
        speculative=SpeculativeConfig(drafter="dspark", max_draft_tokens=num_spec_tokens),
    )
    return ModelRunner.load(path, cfg, OpTable.reference(), mtp=True, draft_model=DSparkLayers)


def draft_rings(runner: ModelRunner, slot: int, table: list[int], end: int) -> dict:
    """The draft rings' rows of a request's last ``W`` positions (what its next block reads)."""
    cfg = runner.model_config
    w, rows = cfg.sliding_window, cfg.sliding_window + runner.num_spec_tokens
    ring = [slot * rows + x % rows for x in range(max(0, end - w), end)]
    first = cfg.num_hidden_layers
    return {
        (layer, "window"): runner.cache.get(layer, "window")[ring]
        for layer in range(first, first + cfg.num_nextn_predict_layers)
    }


@pytest.mark.slow
def test_draft_rings_after_rejected_drafts_equal_accepted_tokens_only(v41_dspark_dir):
    s = 5
    a, b = _runner(v41_dspark_dir, s), _runner(v41_dspark_dir, s)
    g = torch.Generator().manual_seed(4)
    verify = [(int(n) + 1, s - int(n)) for n in torch.randint(0, s + 1, (8,), generator=g)]
    steps = _prefill(13, chunk=6) + verify + [(1, 0), (2, 3), (1, 0)]
    seq = _ids(8, sum(n for n, _ in steps))
    run_pair(a, b, seq, steps, neighbour=_ids(9, len(steps)), slots=(0, 1), state=draft_rings)
    end = sum(n for n, _ in steps)  # the next block's anchor position
    block = [7] + [a.model.dspark.noise_token_id] * 4
    ua, ya = a.draft_model.execute([SeqChunk(0, block, end, [])])
    ub, yb = b.draft_model.execute([SeqChunk(1, block, end, [])])
    assert torch.equal(ua, ub) and torch.equal(ya, yb)
