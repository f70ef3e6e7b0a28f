"""The indexer's head-weight scale ``H**-0.5`` folded into its projection at load.

Where ``H**-0.5`` is a power of two (V4-Flash's 64 heads: 1/8) the model scales the scorer's
projection weight once instead of the head weights at every step: an exact rescaling, so the
engine's tokens and logprobs are bitwise those of the model scaling at run time; elsewhere (the
tiny model's 8 heads) nothing is folded.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.deepseek_v4 import attention
from deepinfer_core.models.deepseek_v4.tiny import make_tiny


def _run(model_dir, **kwargs) -> tuple[list, list]:
    llm = LLM(model=str(model_dir), backend="reference", dtype="bfloat16", max_model_len=96, **kwargs)
    layers = llm.engine.runner.model.layers
    folded = [layer.attn.scale_folded for layer in layers if layer.attn.indexer is not None]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    # prompts past the indexer's top-k of compressed entries (4 of ratio 4: 16+ tokens)
    prompts = [{"prompt_token_ids": list(range(5, 45))}, {"prompt_token_ids": list(range(60, 93))}]
    outs = llm.generate(prompts, params)
    got = [(o.outputs[0].token_ids, [sorted(p.items()) for p in o.outputs[0].logprobs]) for o in outs]
    return folded, got


@pytest.mark.parametrize("heads", [16, 4])
def test_folded_scale_gives_bitwise_the_run_time_scale(tmp_path, monkeypatch, heads):
    model = make_tiny(tmp_path / "m", dtype=torch.bfloat16, config={"index_n_heads": heads})
    folded, tokens = _run(model)
    assert folded and all(folded)
    monkeypatch.setattr(attention, "fold_power_of_two", lambda w, factor: (w, False))
    unfolded, reference = _run(model)
    assert not any(unfolded)
    assert tokens == reference


def test_no_fold_where_the_scale_is_not_a_power_of_two(tiny_dir):
    folded, _ = _run(tiny_dir)  # 8 heads: 8**-0.5
    assert folded and not any(folded)


def test_fold_power_of_two_is_exact_and_refuses_the_rest():
    w = torch.randn(8, 16).to(torch.bfloat16)
    scaled, ok = attention.fold_power_of_two(w, 64**-0.5)
    assert ok and torch.equal(scaled, w * 0.125) and torch.equal(scaled.float() * 8, w.float())
    assert attention.fold_power_of_two(w, 8**-0.5) == (w, False)
    assert attention.fold_power_of_two(w.to(torch.int32), 0.5)[1] is False


def test_the_comparison_sees_the_indexer(tmp_path, monkeypatch):
    """A wrong fold (negated head weights: the indexer picks its worst entries) changes the
    outputs, so the equality above is not vacuous."""
    model = make_tiny(tmp_path / "m", dtype=torch.bfloat16, config={"index_n_heads": 16})
    _, right = _run(model)
    monkeypatch.setattr(attention, "fold_power_of_two", lambda w, factor: (w * -factor, True))
    _, wrong = _run(model)
    assert wrong != right
