"""The attention output rotated back through its rope slice alone (:func:`derotate_output` above
``DEROTATE_SLICE_ROWS`` tokens): the same values as the whole-vector ``apply_rope``."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.deepseek_v4 import rope as v4_rope
from deepinfer_core.models.deepseek_v4.tiny import make_tiny
from deepinfer_core.ops import OpTable
from deepinfer_core.plugins import get_plugins


def _ops(backend: str) -> OpTable:
    return OpTable(get_plugins().get_backend(backend).load_ops(), backend=backend)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("tokens", [5, 300])
def test_derotate_output_equals_the_whole_vector_rotation(backend, tokens):
    g = torch.Generator().manual_seed(tokens)
    out = torch.randn(tokens, 4, 48, generator=g).to(torch.bfloat16)
    cos, sin = (torch.randn(tokens, 8, generator=g) for _ in range(2))
    ops = _ops(backend)
    want = ops.apply_rope(out, cos, -sin)
    got = v4_rope.derotate_output(ops, out.clone(), {"main": (cos, sin)}, "main")
    assert torch.equal(got, want)


def _generate(model_dir) -> list:
    llm = LLM(model=str(model_dir), backend="reference", dtype="bfloat16", max_model_len=96)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": list(range(3, 60))}], params)
    return [(o.outputs[0].token_ids, [sorted(p.items()) for p in o.outputs[0].logprobs]) for o in outs]


def test_engine_tokens_and_logprobs_unchanged_by_the_slice_path(tmp_path, monkeypatch):
    model = make_tiny(tmp_path / "m", dtype=torch.bfloat16)
    whole = _generate(model)
    monkeypatch.setattr(v4_rope, "DEROTATE_SLICE_ROWS", 0)  # every step through the slice
    assert _generate(model) == whole
