"""``batch_invariant=True`` end to end on the built-in tiny model: a request's logits and
logprobs are bitwise the same alone, batched with other requests, or with another prefill
chunk size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.models.deepseek_v4 import tiny
from deepinfer_core.ops import OpTable
from tests.engine.test_graphs import _record_replays

TARGET_LEN = 70  # > window (8), many CSA (4) and HCA (16) windows, indexer top-k active
DECODES = 3
CHUNK_SIZES = (1, 2, 5, 9, 3)


def _runner(path: Path, batch_invariant: bool) -> ModelRunner:
    cfg = EngineConfig(
        model=str(path), dtype="float32", max_num_seqs=32, max_model_len=256, batch_invariant=batch_invariant
    )
    return ModelRunner.load(path, cfg, OpTable.reference())


def _ids(seed: int, n: int, vocab: int = tiny.TINY_VOCAB_SIZE) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def _target_logits(
    runner: ModelRunner, target: list[int], prefill_chunk: int, num_others: int
) -> torch.Tensor:
    """Logits of every position of ``target`` (slot 0): its prompt in chunks of
    ``prefill_chunk``, then ``DECODES`` one-token steps, while ``num_others`` requests of
    other lengths run their own chunks (1..9 tokens, starting at other positions) beside it."""
    kv = runner.kv_cache
    prompt_len = len(target) - DECODES
    others = [_ids(100 + j, 40 + 7 * j) for j in range(num_others)]
    seqs = [target, *others]
    tables = [kv.allocate_pages(kv.pages_needed(len(s))) for s in seqs]
    done = [0] + [(5 * j) % 17 for j in range(num_others)]  # others start mid-sequence ...
    for j, s in enumerate(others, start=1):  # ... after a warm-up of their own
        if done[j]:
            runner.execute([SeqChunk(j, s[: done[j]], 0, tables[j], sample=False)])
    outs, step = [], 0
    while done[0] < len(target):
        chunks = []
        for j, s in enumerate(seqs):
            if done[j] >= len(s):
                continue
            if j == 0:
                n = min(prefill_chunk, prompt_len - done[0]) if done[0] < prompt_len else 1
            else:
                n = CHUNK_SIZES[(j + step) % len(CHUNK_SIZES)]
            part = s[done[j] : done[j] + n]
            chunks.append(SeqChunk(j, part, done[j], tables[j], sample=True, all_logits=j == 0))
            done[j] += len(part)
        logits = runner.execute(chunks)
        outs.append(logits[: len(chunks[0].token_ids)])  # the target is the first chunk
        step += 1
    for t in tables:
        kv.free_pages(t)
    return torch.cat(outs)


@pytest.fixture(scope="module")
def invariant_runner(tiny_dir: Path) -> ModelRunner:
    return _runner(tiny_dir, batch_invariant=True)


@pytest.fixture(scope="module")
def target_alone(invariant_runner: ModelRunner) -> torch.Tensor:
    target = _ids(7, TARGET_LEN + DECODES)
    return _target_logits(invariant_runner, target, TARGET_LEN, 0)


@pytest.mark.parametrize(
    ("prefill_chunk", "num_others"),
    [
        pytest.param(1, 0, marks=pytest.mark.slow),  # one token per step: the most model calls
        (5, 0),
        (TARGET_LEN, 1),
        (TARGET_LEN, 7),
        (5, 7),
        pytest.param(TARGET_LEN, 31, marks=pytest.mark.slow),
        pytest.param(1, 31, marks=pytest.mark.slow),
    ],
)
def test_logits_bitwise_equal_alone_batched_and_chunked(
    invariant_runner, target_alone, prefill_chunk, num_others
):
    target = _ids(7, TARGET_LEN + DECODES)
    got = _target_logits(invariant_runner, target, prefill_chunk, num_others)
    assert got.shape == target_alone.shape == (TARGET_LEN + DECODES, tiny.TINY_VOCAB_SIZE)
    assert torch.equal(got, target_alone)


def test_without_the_mode_logits_depend_on_the_batch_but_stay_close(tiny_dir: Path, target_alone):
    """The engine test can fail: the normal (speed-tuned) path differs in the last bits,
    and the invariant path stays within fp32 summation-order distance of it."""
    runner = _runner(tiny_dir, batch_invariant=False)
    target = _ids(7, TARGET_LEN + DECODES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared, loaded CPU makes 2-thread OpenMP crawl; 1 thread still differs
    try:
        alone = _target_logits(runner, target, TARGET_LEN, 0)
        batched = _target_logits(runner, target, TARGET_LEN, 7)
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(alone, batched)
    torch.testing.assert_close(batched, alone, atol=1e-4, rtol=0)
    torch.testing.assert_close(target_alone, alone, atol=1e-4, rtol=0)


def test_llm_logprobs_identical_alone_and_batched(tiny_dir: Path):
    llm = LLM(model=str(tiny_dir), backend="reference", batch_invariant=True, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    target = {"prompt_token_ids": _ids(7, 50)}
    others = [{"prompt_token_ids": _ids(200 + j, 10 + 13 * j)} for j in range(7)]
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0]
    batched = llm.generate([*others[:3], target, *others[3:]], params, use_tqdm=False)[3].outputs[0]
    assert alone.token_ids == batched.token_ids
    assert alone.logprobs is not None and len(alone.logprobs) == 8
    assert alone.logprobs == batched.logprobs  # float values compared exactly


def test_batch_invariance_is_refused_where_the_backend_does_not_declare_it():
    from deepinfer_core.backends import BackendSpec
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.errors import ConfigError
    from deepinfer_core.hookspecs import hookimpl
    from deepinfer_core.ops.norm import rms_norm
    from deepinfer_core.testing.managers import manager_with_plugin

    class Plugin:
        @hookimpl
        def deepinfer_register_backends(self, register):
            register(BackendSpec(name="no_bi", device_type="cpu", priority=5, ops={"rms_norm": rms_norm}))
            register(
                BackendSpec(
                    name="bi_cpu",
                    device_type="cpu",
                    priority=4,
                    ops={"rms_norm": rms_norm},
                    batch_invariant_devices=("cpu",),
                )
            )

    manager = manager_with_plugin(Plugin(), "bi_test")
    with pytest.raises(ConfigError, match="backend 'no_bi' does not guarantee batch invariance on cpu"):
        LLMEngine(EngineConfig(backend="no_bi", batch_invariant=True), plugins=manager)
    # declared on cpu, and its fallback ops are the reference, which holds on cpu too
    assert LLMEngine(
        EngineConfig(backend="bi_cpu", batch_invariant=True), plugins=manager
    ).config.batch_invariant
    assert LLMEngine(EngineConfig(backend="no_bi"), plugins=manager).backend.name == "no_bi"


def test_the_mode_runs_its_gemms_on_the_backends_tile_matmul(tiny_dir: Path):
    """The engine hands the table's ``tile_matmul`` to the mode: a backend providing it sees
    every fixed-tile product (and only in the mode), and the tokens are the reference's."""
    from deepinfer_core.backends import BackendSpec
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.hookspecs import hookimpl
    from deepinfer_core.ops.linear import tile_matmul
    from deepinfer_core.testing.managers import manager_with_plugin

    calls: list[tuple[int, ...]] = []

    def counting(a, b):
        calls.append(tuple(a.shape))
        return tile_matmul(a, b)

    class Plugin:
        @hookimpl
        def deepinfer_register_backends(self, register):
            register(
                BackendSpec(
                    name="tiles",
                    device_type="cpu",
                    priority=5,
                    ops={"tile_matmul": counting},
                    batch_invariant_devices=("cpu",),
                )
            )

    manager = manager_with_plugin(Plugin(), "tiles_test")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": _ids(7, 20)}
    tokens = {}
    for bi in (False, True):
        calls.clear()
        engine = LLMEngine(
            EngineConfig(model=str(tiny_dir), backend="tiles", batch_invariant=bi), plugins=manager
        )
        engine.add_request("r", prompt["prompt_token_ids"], params)
        finished = []
        while engine.has_unfinished():
            finished += engine.step()
        tokens[bi] = finished[0].outputs[0].token_ids
        assert bool(calls) == bi
    assert all(shape[1] == 64 for shape in calls)  # ROW_TILE rows per tile
    reference = LLM(model=str(tiny_dir), backend="reference", batch_invariant=True)
    assert reference.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == tokens[True]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["tiny", "hf_all_types"])
def test_cuda_sm100_logprobs_identical_alone_batched_and_chunked(
    tiny_dir: Path, hf_model, model: str, dtype: str, graphs: bool
):
    """On the GPU with the ``cuda_sm100`` backend, eager and with CUDA graphs, on the built-in
    tiny model and on a checkpoint saved by HF transformers: a request's logprobs are bitwise
    the same alone, among 31 others (among 7 with the same prompt), and with another prefill
    chunk size."""
    path, vocab = (
        (tiny_dir, tiny.TINY_VOCAB_SIZE) if model == "tiny" else (hf_model(model.removeprefix("hf_"))[1], 300)
    )
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    target = {"prompt_token_ids": _ids(7, 90, vocab)}
    others = [{"prompt_token_ids": _ids(300 + j, 5 + 11 * j, vocab)} for j in range(31)]
    runs = (
        ("alone", 64, []),
        ("batched", 64, others),
        ("chunked", 24, others[:9]),
        ("same prompt", 64, [target] * 7),
    )
    results = {}
    for label, chunk, batch in runs:
        llm = LLM(
            model=str(path),
            backend="cuda_sm100",
            device="cuda",
            dtype=dtype,
            batch_invariant=True,
            enforce_eager=not graphs,
            max_num_seqs=32,
            max_num_batched_tokens=chunk,
        )
        assert bool(llm.engine.runner.graph_manager.graphs("decode")) == graphs
        replays = _record_replays(llm)
        prompts = [*batch[:5], target, *batch[5:]]
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[label] = outs[min(5, len(batch))].outputs[0]
        assert bool(replays) == graphs, f"{label}: graph replays {replays}"
        llm.shutdown()
    alone = results["alone"]
    assert alone.logprobs is not None and len(alone.logprobs) == 12
    for label, _, _ in runs[1:]:
        assert results[label].token_ids == alone.token_ids, label
        assert results[label].logprobs == alone.logprobs, f"{label}: logprobs differ from alone"
