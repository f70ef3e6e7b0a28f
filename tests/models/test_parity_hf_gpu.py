"""Parity with HF transformers on a CUDA GPU: the ``reference`` and ``cuda_sm100`` backends
against ``DeepseekV4ForCausalLM`` on the same device (fp32), on the parity tests' tiny models:
prompt logits in chunks, and greedy tokens through the engine (continuous batching, chunked
prefill, prefix caching, async scheduling, CUDA graphs) against HF ``generate``."""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer_core.backends import resolve_backend
from deepinfer_core.config import EngineConfig
from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.engine.model_runner import ModelRunner
from tests.models.hf_oracle import CONFIGS

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4  # fp32, as on the CPU (tests/models/test_parity_hf.py)


@pytest.mark.parametrize("backend", ["reference", "cuda_sm100"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_backend_on_the_gpu_matches_hf_there(hf_model, name: str, backend: str) -> None:
    from deepinfer_core import LLM, SamplingParams

    model, path = hf_model(name)
    model = copy.deepcopy(model).to("cuda")  # the session's CPU oracle stays where it is
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 300, (83,), generator=g).tolist()  # > window, many compress windows
    with torch.no_grad():
        ref = model(torch.tensor([ids], device="cuda")).logits[0].float()
    cfg = EngineConfig(model=str(path), dtype="float32", device="cuda", max_num_seqs=4, page_size=16)
    runner = ModelRunner.load(path, cfg, resolve_backend(backend)[1])
    pages = runner.kv_cache.allocate_pages(runner.kv_cache.pages_needed(len(ids)))
    chunks = [
        SeqChunk(0, ids[s : s + 13], s, pages, sample=True, all_logits=True) for s in range(0, len(ids), 13)
    ]
    ours = torch.cat([runner.execute([c]) for c in chunks])
    torch.testing.assert_close(ours, ref, atol=LOGIT_ATOL, rtol=0)
    del runner

    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (3, 17, 33, 58, 70)]
    llm = LLM(model=str(path), backend=backend, device="cuda", dtype="float32", max_num_seqs=3,
              max_num_batched_tokens=24)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model.generation_config.eos_token_id = None
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = model.generate(
                torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False, pad_token_id=0
            )
        assert out.outputs[0].token_ids == want[0, len(p) :].tolist(), f"{name}: prompt of {len(p)} tokens"
