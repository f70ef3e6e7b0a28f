"""Parity of the reference engine with HF transformers' DeepseekV4ForCausalLM (the oracle)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.config import EngineConfig
from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.ops import OpTable
from tests.models.hf_oracle import CONFIGS, build_hf_model

pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4  # fp32: differences come only from summation order


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_case(request, hf_model):
    model, path = hf_model(request.param)
    return request.param, model, path


def _runner(path, **kw) -> ModelRunner:
    cfg = EngineConfig(model=str(path), dtype="float32", max_num_seqs=4, **kw)
    return ModelRunner.load(path, cfg, OpTable.reference())


def _prompt_logits(runner: ModelRunner, ids: list[int], chunk: int, slot: int = 0) -> torch.Tensor:
    kv = runner.kv_cache
    pages = kv.allocate_pages(kv.pages_needed(len(ids)))
    out = []
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        out.append(runner.execute([SeqChunk(slot, part, s, pages, sample=True, all_logits=True)]))
    kv.free_pages(pages)
    return torch.cat(out)


@pytest.mark.parametrize("chunk", [1000, 7, pytest.param(1, marks=pytest.mark.slow)])
def test_full_prompt_logits_match_hf(hf_case, chunk):
    name, model, path = hf_case
    runner = _runner(path, page_size=16 if name != "all_types" else 32)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 300, (83,), generator=g).tolist()  # > window, many compress windows
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    ours = _prompt_logits(runner, ids, chunk)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=LOGIT_ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_full_prompt_logits_match_hf_on_the_cpu_backend(hf_case):
    """The ``cpu`` backend's kernels (where its plugin is installed and can build them), in
    place of the reference ops, stay within the same tolerance of HF."""
    from deepinfer_core.plugins import get_plugins
    from deepinfer_core.testing.availability import backend_unavailable_reason

    if (reason := backend_unavailable_reason("cpu")) is not None:
        pytest.skip(reason)
    name, model, path = hf_case
    ops = OpTable(get_plugins().get_backend("cpu").load_ops(), backend="cpu", strict=True)
    cfg = EngineConfig(
        model=str(path), dtype="float32", max_num_seqs=4, page_size=16 if name != "all_types" else 32
    )
    runner = ModelRunner.load(path, cfg, ops)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 300, (83,), generator=g).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    ours = _prompt_logits(runner, ids, 7)  # chunks of 7: prefill and decode-like steps
    torch.testing.assert_close(ours, ref, atol=LOGIT_ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_batched_chunks_of_different_requests_match_hf(hf_case):
    """Several requests in one flat batch, at different offsets, each equals its own HF run."""
    name, model, path = hf_case
    runner = _runner(path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (5, 40, 67)]
    kv = runner.kv_cache
    tables = [kv.allocate_pages(kv.pages_needed(len(p))) for p in prompts]
    done = [0, 0, 0]
    outs: list[list[torch.Tensor]] = [[], [], []]
    step = 0
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        chunks, owners = [], []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                n = [3, 9, 13][(i + step) % 3]
                part = p[done[i] : done[i] + n]
                chunks.append(SeqChunk(i, part, done[i], tables[i], sample=True, all_logits=True))
                owners.append((i, len(part)))
                done[i] += len(part)
        logits = runner.execute(chunks)
        row = 0
        for i, n in owners:
            outs[i].append(logits[row : row + n])
            row += n
        step += 1
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = model(torch.tensor([p])).logits[0]
        torch.testing.assert_close(torch.cat(outs[i]), ref, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.slow
def test_greedy_generation_through_continuous_batching_matches_hf(hf_case):
    """>= 8 prompts of different lengths, chunked prefill under a small token budget,
    continuous batching with fewer slots than prompts: every token equals HF's greedy."""
    from deepinfer_core import LLM, SamplingParams

    name, model, path = hf_case
    g = torch.Generator().manual_seed(3)
    lengths = [3, 9, 17, 26, 33, 41, 58, 70]
    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in lengths]
    llm = LLM(
        model=str(path), backend="reference", dtype="float32", max_num_seqs=5, max_num_batched_tokens=24
    )
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p) :].tolist()
        assert out.outputs[0].token_ids == ref, f"{name}: prompt of {len(p)} tokens diverged"
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("scale_dtype", ["fp32", "ue8m0"])
def test_native_fp8_fp4_checkpoint_matches_hf_on_dequantised_weights(tmp_path, scale_dtype):
    """A native-name checkpoint with FP8 block-scaled linears and packed FP4 experts,
    quantised from an HF model, equals HF run on the dequantised weights."""
    from transformers import DeepseekV4ForCausalLM

    from deepinfer_core.models.deepseek_v4.loader import load_checkpoint
    from deepinfer_core.models.deepseek_v4.writer import save_checkpoint

    model = build_hf_model("all_types")
    cfg_dict = model.config.to_dict()
    save_checkpoint(
        {k: v.clone() for k, v in model.state_dict().items()},
        cfg_dict,
        tmp_path,
        names="native",
        fp8_linear=True,
        fp4_experts=True,
        scale_dtype=scale_dtype,
    )
    runner = _runner(tmp_path)
    deq = load_checkpoint(tmp_path, runner.model_config, torch.float32)
    assert any(not torch.equal(deq[k], v) for k, v in model.state_dict().items()), "nothing was quantised"
    oracle = DeepseekV4ForCausalLM(model.config).eval()
    missing, unexpected = oracle.load_state_dict(deq, strict=False)
    assert not unexpected and all("inv_freq" in m for m in missing)
    ids = torch.randint(2, 300, (75,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = oracle(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_prompt_logits(runner, ids, 16), ref, atol=LOGIT_ATOL, rtol=0)
