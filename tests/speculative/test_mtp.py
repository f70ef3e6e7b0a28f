"""The ``mtp`` drafter: DeepSeek-V4's multi-token-prediction layer.

* Loading: the MTP tensors load from native ``mtp.0.*`` names (and the HF-style
  ``model.mtp.0.*`` ones ``make-tiny`` writes by default), quantised or not, sharing the main
  embedding and head unless the checkpoint has its own; a checkpoint without them is a one-line
  ``ConfigError`` when ``drafter="mtp"`` asks for them, and loads as before otherwise.
* The MTP forward against an independent oracle: the target's hidden streams from HF
  transformers' ``DeepseekV4ForCausalLM`` (a hook on its last layer), the MTP formula in plain
  torch, the MTP block as HF's ``DeepseekV4DecoderLayer`` over the whole sequence with a
  sliding-window mask (no cache); the engine's MTP logits (cache, window ring, one row per
  position) match for every position, and so do recursive depths 2 and 3 through the drafter.
* The engine: outputs equal plain decoding (greedy, seeded; fixed and dspark; prefix caching;
  preemption), and a checkpoint whose MTP layer is built to predict what the (bigram-like)
  target decodes gets its drafts accepted.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import EngineConfig, SpeculativeConfig
from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.deepseek_v4 import tiny
from deepinfer_core.models.deepseek_v4.config import SLIDING, DeepseekV4Config
from deepinfer_core.models.deepseek_v4.loader import load_checkpoint, load_mtp_checkpoint
from deepinfer_core.models.deepseek_v4.names import hf_to_native, is_expert_stack
from deepinfer_core.models.deepseek_v4.params import mtp_parameter_specs, parameter_specs
from deepinfer_core.models.deepseek_v4.writer import save_checkpoint
from deepinfer_core.ops import OpTable
from deepinfer_core.speculative import ComputedChunk, DraftContext
from deepinfer_core.speculative.mtp import MtpDrafter
from deepinfer_core.speculative.mtp_layers import MtpLayers
from deepinfer_core.testing.checkpoints import write_bigram_mtp_checkpoint
from deepinfer_core.testing.observe import record_replays

W = tiny.TINY_CONFIG["sliding_window"]
P = "model.mtp.0."


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118
    return out


def _cfg() -> DeepseekV4Config:
    return DeepseekV4Config.from_dict(dict(tiny.TINY_CONFIG))


# ---- loading ---------------------------------------------------------------------------------
def test_mtp_tensors_load_from_native_names(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg()
    native = tiny.make_tiny(tmp_path / "native", names="native")
    keys = set(_tensors(native))
    for name in (
        "mtp.0.e_proj.weight",
        "mtp.0.hnorm.weight",
        "mtp.0.hc_head_fn",
        "mtp.0.norm.weight",
        "mtp.0.attn.wq_a.weight",
        "mtp.0.attn.attn_sink",
        "mtp.0.ffn.gate.bias",
        "mtp.0.ffn.experts.7.w3.weight",
        "mtp.0.ffn.shared_experts.w2.weight",
        "mtp.0.hc_ffn_fn",
        "mtp.0.attn_norm.weight",
    ):
        assert name in keys, name
    assert not any(k.startswith("model.") for k in keys)
    assert "mtp.0.head.weight" not in keys and "mtp.0.emb.tok_emb.weight" not in keys  # shared
    want = {n: t for n, t in tiny.random_weights(cfg).items() if n.startswith(P)}
    for model_dir in (native, tiny_dir):  # native names, and make-tiny's default HF-style ones
        got = load_mtp_checkpoint(model_dir, cfg, torch.float32)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want)
        # the main load is unchanged: MTP tensors skipped
        assert list(load_checkpoint(model_dir, cfg, torch.float32)) == list(parameter_specs(cfg))


def test_quantised_mtp_and_own_head_and_embedding(tmp_path: Path) -> None:
    """FP8 ``e_proj`` / ``h_proj`` with ``.scale`` siblings, FP4 MTP experts, and the MTP
    layer's own ``head`` / ``emb.tok_emb``: loaded, kept quantised on request, and used."""
    cfg = _cfg()
    weights = tiny.random_weights(cfg)
    g = torch.Generator().manual_seed(5)
    own = {
        P + "lm_head.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.1,
        P + "embed_tokens.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
    }
    save_checkpoint(
        {**weights, **own},
        dict(tiny.TINY_CONFIG),
        tmp_path,
        names="native",
        fp8_linear=True,
        fp4_experts=True,
        fp8_block=(32, 32),
    )
    keys = set(_tensors(tmp_path))
    assert {
        "mtp.0.e_proj.scale",
        "mtp.0.h_proj.scale",
        "mtp.0.head.weight",
        "mtp.0.emb.tok_emb.weight",
    } <= keys
    assert "mtp.0.head.scale" not in keys  # heads stay unquantised
    cfg = DeepseekV4Config.from_file(tmp_path)  # with its quantization_config (32x32 blocks)
    got = load_mtp_checkpoint(tmp_path, cfg, torch.float32)
    assert torch.equal(got[P + "lm_head.weight"], own[P + "lm_head.weight"])
    assert torch.equal(got[P + "embed_tokens.weight"], own[P + "embed_tokens.weight"])
    err = (got[P + "e_proj.weight"] - weights[P + "e_proj.weight"]).abs().max()
    assert 0 < err < 0.05  # dequantised FP8
    kept = load_mtp_checkpoint(tmp_path, cfg, torch.float32, keep_quantized=True)
    assert type(kept[P + "e_proj.weight"]).__name__ == "QuantizedTensor"
    assert type(kept[P + "mlp.experts.gate_up_proj"]).__name__ == "QuantizedTensor"
    runner = _runner(tmp_path)
    assert runner.model.mtp.head is not runner.model.w["lm_head.weight"]
    assert torch.equal(runner.model.mtp.head, own[P + "lm_head.weight"])


@pytest.mark.slow
def test_checkpoint_without_mtp_is_a_config_error_only_for_the_mtp_drafter(tmp_path: Path) -> None:
    cfg = _cfg()
    main = {n: t for n, t in tiny.random_weights(cfg).items() if not n.startswith(P)}
    lacking = tmp_path / "lacking"
    save_checkpoint(main, dict(tiny.TINY_CONFIG), lacking, names="native")
    with pytest.raises(ConfigError) as e:
        _llm(lacking, {"drafter": "mtp"})
    msg = str(e.value)
    assert "\n" not in msg and "num_nextn_predict_layers=1" in msg and "mtp.0.enorm.weight" in msg, msg
    partial = tmp_path / "partial"
    weights = tiny.random_weights(cfg)
    save_checkpoint(
        {n: t for n, t in weights.items() if n != P + "h_proj.weight"},
        dict(tiny.TINY_CONFIG),
        partial,
        names="native",
    )
    with pytest.raises(ConfigError, match=r"lacks 1 tensor.*: mtp\.0\.h_proj\.weight; "):
        _llm(partial, {"drafter": "mtp"})
    none = tmp_path / "none"
    save_checkpoint(main, {**tiny.TINY_CONFIG, "num_nextn_predict_layers": 0}, none)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=0"):
        _llm(none, {"drafter": "mtp"})
    # other drafters, or no speculation, load them as before
    for path in (lacking, none):
        _llm(path, {"drafter": "ngram"}).generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2)
        )


def test_config_mtp_layer_types() -> None:
    n = tiny.TINY_CONFIG["num_hidden_layers"]
    native = {k: v for k, v in tiny.TINY_CONFIG.items() if k not in ("layer_types", "compress_rates")}
    native["compress_ratios"] = [0, 4, 128, 4, 128]  # the last: the MTP layer's (HCA)
    cfg = DeepseekV4Config.from_dict(native)
    assert cfg.mtp_layer_types == ["heavily_compressed_attention"] and cfg.compress_ratio(n) == 128
    assert _cfg().layer_type(n) == SLIDING  # no ratio given: sliding window
    names = {hf_to_native(k) for k in mtp_parameter_specs(cfg) if not is_expert_stack(k)}
    assert "mtp.0.attn.compressor.wkv.weight" in names and "mtp.0.ffn.gate.tid2eid" not in names
    with pytest.raises(ConfigError, match="mtp_layer_types has 2 entries"):
        DeepseekV4Config.from_dict({**tiny.TINY_CONFIG, "mtp_layer_types": [SLIDING, SLIDING]})


# ---- the MTP forward against an independent oracle -----------------------------------------------
def _runner(path: Path, slots: int = 2, k: int = 3) -> ModelRunner:
    cfg = EngineConfig(
        model=str(path),
        dtype="float32",
        max_num_seqs=slots,
        max_model_len=64,
        speculative=SpeculativeConfig(drafter="mtp", max_draft_tokens=k),
    )
    return ModelRunner.load(path, cfg, OpTable.reference(), mtp=True, draft_model=MtpLayers)


class Oracle:
    """The MTP layer recomputed from the checkpoint without any cache: HF transformers for the
    target's hidden streams and for the MTP's decoder block, the rest in plain torch."""

    def __init__(self, model_dir: Path):
        transformers = pytest.importorskip("transformers")
        self.hf = transformers.DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.cfg = _cfg()
        w = _tensors(model_dir)
        self.w = {n.removeprefix(P): t for n, t in w.items() if n.startswith(P)}
        self.embed, self.head = w["model.embed_tokens.weight"], w["lm_head.weight"]  # shared
        hf_cfg = transformers.DeepseekV4Config(
            **{
                **copy.deepcopy(tiny.TINY_CONFIG),
                "num_hidden_layers": 1,
                "layer_types": [SLIDING],
                "mlp_layer_types": ["moe"],
            }
        )
        hf_cfg._attn_implementation = "eager"
        self.block = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4DecoderLayer(hf_cfg, 0)
        block_w = {
            n: t
            for n, t in self.w.items()
            if n.startswith(("self_attn.", "mlp.", "input_", "post_", "attn_hc", "ffn_hc"))
        }
        missing, unexpected = self.block.load_state_dict(block_w, strict=False)
        assert not unexpected and not missing, (missing, unexpected)
        self.block.eval()

    def target_hidden(self, ids: list[int]) -> torch.Tensor:
        """The target's last-layer streams ``[T, N, D]`` (before ``hc_head``)."""
        seen = {}
        hook = self.hf.model.layers[-1].register_forward_hook(lambda m, a, out: seen.update(h=out))
        with torch.no_grad():
            self.hf(torch.tensor([ids]))
        hook.remove()
        return seen["h"][0]

    def mtp(self, h: torch.Tensor, next_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP rows at positions ``0 .. T-1``: ``h`` ``[T, N, D]``, the token after each
        position; returns logits ``[T, V]`` and output streams ``[T, N, D]``."""
        cfg, w = self.cfg, self.w
        eps, t = cfg.rms_norm_eps, h.shape[0]

        def rms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * g

        pos = torch.arange(t)
        e = self.embed[torch.tensor(next_ids)]
        e = torch.where((pos == 0)[:, None], 0.0, e)  # no input at position 0
        x = (
            rms(h, w["hnorm.weight"]) @ w["h_proj.weight"].T
            + (rms(e, w["enorm.weight"]) @ w["e_proj.weight"].T)[:, None]
        )
        mask = torch.full((t, t), float("-inf"))
        for i in range(t):
            mask[i, max(0, i - W + 1) : i + 1] = 0.0  # causal sliding window
        rope = {fam: self.hf.model.rotary_emb(x, pos[None], layer_type=fam) for fam in ("main", "compress")}
        with torch.no_grad():
            x = self.block(
                x[None],
                position_embeddings=rope,
                position_ids=pos[None],
                attention_mask=mask[None, None],
                input_ids=torch.tensor([next_ids]),
            )[0]
        flat = x.flatten(1)
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
        pre = (
            torch.sigmoid(flat @ w["hc_head.hc_fn"].T * w["hc_head.hc_scale"] + w["hc_head.hc_base"])
            + cfg.hc_eps
        )
        y = (pre[..., None] * x).sum(1)
        return rms(y, w["norm.weight"]) @ self.head.T, x


@pytest.fixture(scope="module")
def oracle(tiny_dir: Path) -> Oracle:
    return Oracle(tiny_dir)


def _ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, tiny.TINY_VOCAB_SIZE, (n,), generator=g).tolist()


def _prefill(runner: ModelRunner, slot: int, ids: list[int]) -> torch.Tensor:
    """Run the target over ``ids`` in ``slot``; its hidden states ``[len(ids), N, D]``."""
    table = list(range(slot * 4, slot * 4 + 4))
    runner.execute([SeqChunk(slot, list(ids), 0, table, table_key=(f"r{slot}", 0))])
    return runner.hidden[: len(ids)].clone()


def test_mtp_logits_match_the_oracle_at_every_position(tiny_dir: Path, oracle: Oracle) -> None:
    ids = _ids(21)  # 20 positions: the MTP window (8) slides over them
    runner = _runner(tiny_dir)
    hidden = _prefill(runner, 0, ids[:-1])
    ref_h = oracle.target_hidden(ids[:-1])
    torch.testing.assert_close(hidden, ref_h, rtol=1e-4, atol=1e-4)
    n = len(ids) - 1
    chunk = SeqChunk(0, ids[1:], 0, [0, 1, 2, 3], table_key=("r0", 0))
    logits, streams = runner.draft_model.execute([chunk], hidden, list(range(n)))
    ref_logits, ref_streams = oracle.mtp(ref_h, ids[1:])
    torch.testing.assert_close(streams, ref_streams, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert logits.std() > 0.3  # not degenerate


@pytest.mark.parametrize("t", [3, 13])
def test_drafts_follow_the_oracle_recursively(tiny_dir: Path, oracle: Oracle, t: int) -> None:
    """The drafter after a prefill of positions ``0..t`` (catch-up through ``observe``): draft 1
    is the oracle's argmax at ``t``; draft ``j`` runs the MTP at ``t + j - 1`` on the previous
    depth's output streams and draft ``j - 1`` (checked for depths 2 and 3 against the oracle
    over the extended sequence), with the softmax probabilities as confidences."""
    ids = _ids(t + 2, seed=t)
    runner = _runner(tiny_dir)
    drafter = MtpDrafter(SpeculativeConfig(drafter="mtp", max_draft_tokens=3), tiny.TINY_VOCAB_SIZE)
    drafter.bind(runner)
    slot = 1
    _prefill(runner, slot, ids[:-1])
    table = list(range(4, 8))
    drafter.observe([ComputedChunk("a", 0, ids[1:], 0, True, slot, table, ("r1", 0))])
    (draft,) = drafter.propose([DraftContext("a", ids, t + 1, 3)])
    h = oracle.target_hidden(ids[:-1])
    nxt = list(ids[1:])
    for depth in range(3):
        logits, streams = oracle.mtp(h, nxt)
        probs = torch.softmax(logits[-1], -1)
        assert draft.token_ids[depth] == int(probs.argmax()), depth
        assert draft.confidence[depth] == pytest.approx(float(probs.max()), rel=1e-4)
        h = torch.cat([h, streams[-1:]])  # depth + 1: the next position, on the output streams
        nxt.append(draft.token_ids[depth])
    assert len(draft.token_ids) == 3


# ---- the engine --------------------------------------------------------------------------------
PROMPTS = [[5, 9, 23, 7, 7, 41, 3], [88, 12, 4], [17] * 11, list(range(60, 75))]


def _llm(model_dir: Path, speculative=None, **kw) -> LLM:
    return LLM(model=str(model_dir), max_num_seqs=8, speculative=speculative, **kw)


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True),
}


@pytest.fixture(scope="module")
def plain(tiny_dir: Path) -> dict[str, list[list[int]]]:
    llm = _llm(tiny_dir)
    return {
        k: _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], v)) for k, v in PARAMS.items()
    }


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("method", ["fixed", "dspark"])
@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_outputs_equal_plain_decoding(
    tiny_dir: Path, plain, kind: str, method: str, async_scheduling
) -> None:
    """With async scheduling a step without drafts is launched before the previous one is
    processed, and the MTP catch-up of a step reads the hidden rows the runner kept of it."""
    spec = {"drafter": "mtp", "method": method, "max_draft_tokens": 3}
    llm = _llm(tiny_dir, spec, async_scheduling=async_scheduling)
    assert llm.engine.config.async_scheduling == async_scheduling
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS[kind])
    assert _tokens(outs) == plain[kind]
    m = llm.get_metrics()["speculative"]
    assert m["num_proposed_tokens"] > 0, m
    if method == "fixed":
        assert m["num_draft_tokens"] == m["num_proposed_tokens"], m


@pytest.mark.slow
def test_prefix_caching_and_preemption(tiny_dir: Path) -> None:
    """A prefix-cache hit (SWA replay: the MTP cache caught up over the replayed rows) and a
    cache too small for every request (preempted requests recompute, the MTP cache with them)."""
    params = SamplingParams(temperature=0.7, seed=4, max_tokens=24, ignore_eos=True)
    shared = [3 + (i * 7) % 50 for i in range(40)]
    prompts = [shared + [1, 2], shared + [9], *PROMPTS]
    ref = [
        _tokens(_llm(tiny_dir, num_cache_pages=8).generate([{"prompt_token_ids": p}], params))
        for p in prompts
    ]
    spec = _llm(tiny_dir, {"drafter": "mtp", "method": "fixed", "max_draft_tokens": 4}, num_cache_pages=8)
    outs = [_tokens(spec.generate([{"prompt_token_ids": p}], params)) for p in prompts[:2]]
    outs += [_tokens(spec.generate([{"prompt_token_ids": p} for p in prompts[2:]], params))]
    assert outs[:2] == ref[:2]
    assert outs[2] == [r[0] for r in ref[2:]]
    metrics = spec.get_metrics()
    assert metrics["num_prefix_hit_tokens"] > 0 and metrics["num_preemptions"] > 0, metrics
    assert metrics["speculative"]["num_draft_tokens"] > 0


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model whose MTP layer predicts the target's greedy token after next exactly
    (:func:`~deepinfer_core.testing.checkpoints.write_bigram_mtp_checkpoint`)."""
    out = write_bigram_mtp_checkpoint(tmp_path_factory.mktemp("bigram"))
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    return out


def test_a_right_mtp_gets_its_drafts_accepted(bigram_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    base = _llm(bigram_dir)
    ref = _tokens(base.generate(prompts, params))
    spec = _llm(bigram_dir, {"drafter": "mtp", "method": "fixed", "max_draft_tokens": 4})
    assert _tokens(spec.generate(prompts, params)) == ref
    m = spec.get_metrics()["speculative"]
    assert m["acceptance_rate"] > 0.95, m
    assert m["mean_acceptance_length"] > 4.0, m
    assert spec.get_metrics()["num_steps"] < base.get_metrics()["num_steps"] / 2


@pytest.mark.slow
def test_graph_replays_keep_the_hidden_states(tiny_dir: Path) -> None:
    """Decode, verify and MTP steps (draft depths, one-row catch-ups) replayed from (emulated)
    graphs, padded to their bucket, leave the same hidden states as eager steps: the drafts
    and outputs are bitwise those of an eager run (batch invariant)."""
    from deepinfer_core.engine.graphs import EmulatedGraph

    params = SamplingParams(temperature=0.8, seed=6, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    spec = {"drafter": "mtp", "method": "fixed", "max_draft_tokens": 3}

    def run(graphs: bool) -> tuple[list[list[int]], list, list[str]]:
        llm = _llm(tiny_dir, spec, batch_invariant=True, enforce_eager=True)
        runner, drafter = llm.engine.runner, llm.engine.spec.drafter
        replays: list[str] = []
        if graphs:
            assert runner.capture_graphs(EmulatedGraph) is None
            kinds = {f: runner.graph_manager.graphs(f) for f in ("decode", "verify", "mtp")}
            record_replays(kinds, replays)
        proposed: list = []
        propose = drafter.propose

        def record(contexts):
            drafts = propose(contexts)
            proposed.append([(list(d.token_ids), list(d.confidence or [])) for d in drafts])
            return drafts

        drafter.propose = record
        return _tokens(llm.generate(prompts, params)), proposed, replays

    eager, graphed = run(False), run(True)
    assert {"verify", "mtp"} <= set(graphed[2]), set(graphed[2])
    assert graphed[0] == eager[0]
    assert graphed[1] == eager[1]


def test_replay_tail_covers_the_mtp_window(tiny_dir: Path) -> None:
    """A prefix-cache hit replays one more window with the MTP layer (it reads the last
    layer's output, so its window needs that one exact)."""
    from deepinfer_core.models.deepseek_v4.family import FAMILY

    cfg = _cfg()
    assert FAMILY.replay_tail(cfg, 8, extra_layers=1) == FAMILY.replay_tail(cfg, 8) + W
    runner = _runner(tiny_dir)
    assert runner.replay_tail == FAMILY.replay_tail(cfg, runner.page_size, extra_layers=1)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["tiny", "bigram"])
def test_cuda_mtp_outputs_equal_plain_decoding(tiny_dir: Path, bigram_dir: Path, which: str) -> None:
    """On the GPU (``cuda_sm100``, CUDA decode and verify graphs, fp32, batch invariant): the MTP
    drafter's runs give plain decoding's tokens and logprobs bitwise; the pass-through MTP of
    the bigram model gets its drafts accepted."""
    model_dir = tiny_dir if which == "tiny" else bigram_dir
    kw = {"backend": "cuda_sm100", "device": "cuda", "dtype": "float32", "batch_invariant": True}
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, logprobs=2)
    if which == "bigram":
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _llm(model_dir, **kw).generate(prompts, params)
    spec = _llm(model_dir, {"drafter": "mtp", "method": "fixed", "max_draft_tokens": 4}, **kw)
    assert spec.engine.runner.graph_manager.graphs("verify"), "no verify graph captured"
    outs = spec.generate(prompts, params)
    assert _tokens(outs) == _tokens(ref)
    assert [o.outputs[0].logprobs for o in outs] == [o.outputs[0].logprobs for o in ref]
    m = spec.get_metrics()["speculative"]
    assert m["num_draft_tokens"] > 0
    if which == "bigram":
        assert m["acceptance_rate"] > 0.95, m


@pytest.mark.gpu
def test_cuda_mtp_catch_up_never_waits_for_the_device(tiny_dir: Path) -> None:
    """With async scheduling, the MTP drafter follows a step while the next one runs on the
    device: its catch-up (:meth:`MtpDrafter.observe`) must enqueue work without a host sync
    (a plain ``.to(device)`` of an index waits for the whole stream and so took the overlap
    away: DSpark with MTP ran at 0.6–0.8x of plain decoding on the H200 where it did not
    draft).  CUDA's sync debug mode turns any synchronising call inside it into an error."""
    kw = {"backend": "cuda_sm100", "device": "cuda", "dtype": "bfloat16"}
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    spec = _llm(tiny_dir, {"drafter": "mtp", "method": "dspark", "max_draft_tokens": 3}, **kw)
    assert spec.engine.config.async_scheduling
    drafter = spec.engine.spec.drafter
    observe, calls = drafter.observe, []

    def strict_observe(chunks):
        torch.cuda.set_sync_debug_mode("error")
        try:
            observe(chunks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        calls.append(len(chunks))

    drafter.observe = strict_observe
    outs = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert sum(calls) > len(PROMPTS) * 10, calls  # it followed the decode steps
