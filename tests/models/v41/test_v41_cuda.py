"""DeepSeek-V4.1 on the GPU (``cuda_sm100``; skipped without one): the engine's prompt
logprobs equal the reference backend's on the CPU to float32 round-off, decode steps replayed
from CUDA graphs give the eager steps' tokens and logprobs bit for bit (batch invariant), and
the DSpark drafter stays lossless there.  (The Engram tables' in-place reads on the GPU:
``test_v41_model.py::test_engram_tables_are_memory_mapped_not_copied[...-cuda]``.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deepinfer_core.llm import LLM
from deepinfer_core.sampling.params import SamplingParams
from tests.models.v41.conftest import v41_llm

pytestmark = pytest.mark.gpu

PROMPTS = [list(range(7 + 5 * i, 7 + 5 * i + n)) for i, n in enumerate((9, 40, 23, 70))]


def _gpu_llm(model_dir: Path, **options: Any) -> LLM:
    """The installed plugins' ``cuda_sm100`` (the core registers ``deepseek_v41``)."""
    return LLM(model=str(model_dir), backend="cuda_sm100", device="cuda", dtype="float32", **options)


def test_cuda_prompt_logprobs_equal_the_cpu_reference(v41_plain_dir):
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = v41_llm(v41_plain_dir).generate(prompts, params, use_tqdm=False)
    got = _gpu_llm(v41_plain_dir).generate(prompts, params, use_tqdm=False)
    for prompt, w, g in zip(PROMPTS, want, got, strict=True):
        for token, lw, lg in zip(prompt[1:], w.prompt_logprobs[1:], g.prompt_logprobs[1:], strict=True):
            assert abs(lw[token] - lg[token]) < 1e-3  # the prompt's own token
            assert all(abs(lw[t] - lg[t]) < 1e-3 for t in lw.keys() & lg.keys())


@pytest.mark.parametrize("model", ["v41_dir", "v41_dspark_dir"])
def test_cuda_graphs_equal_eager_bitwise(model, request):
    """Decode (and, with the drafter, verify) steps replayed from CUDA graphs equal eager steps
    bit for bit in batch-invariant mode; with the DSpark drafter the tokens are plain decoding's."""
    model_dir = request.getfixturevalue(model)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=16, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    eager = _gpu_llm(model_dir, batch_invariant=True, enforce_eager=True)
    want = eager.generate(prompts, params, use_tqdm=False)
    llm = _gpu_llm(model_dir, batch_invariant=True)
    assert llm.engine.runner.graph_manager.graphs("decode"), "CUDA graphs were not captured"
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert [g.outputs[0].logprobs for g in got] == [w.outputs[0].logprobs for w in want]
    if model == "v41_dspark_dir":
        dspark = {"method": "dspark", "drafter": "dspark"}
        spec = _gpu_llm(model_dir, batch_invariant=True, speculative=dspark)
        assert spec.engine.runner.graph_manager.graphs("dspark"), "no DSpark block graph was captured"
        outs = spec.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want]
        assert spec.get_metrics()["speculative"]["num_draft_tokens"] > 0
