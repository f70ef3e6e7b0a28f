"""Side-stream overlap (``deepinfer_core.ops.overlap``): when a block's chains run on two CUDA
streams, that the results are one stream's bit for bit; that the models join each branch before
they read what it computed or wrote (on the CPU, the branches deferred to their joins: the other
order two streams may take); how a bad setting is refused."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.deepseek_v4.fused import FusedProjection
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.overlap import (
    DEFAULT_MAX_ROWS,
    DEFER_ENV,
    OVERLAP_ENV,
    fork,
    max_overlap_rows,
    on_side_stream,
    overlap_applies,
    side_stream,
)
from deepinfer_core.weights.quant import QuantizedTensor, quant_fp8


def test_the_row_limit_reads_the_environment_and_names_a_bad_value(monkeypatch):
    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    assert max_overlap_rows() == DEFAULT_MAX_ROWS
    monkeypatch.setenv(OVERLAP_ENV, "0")
    assert max_overlap_rows() == 0
    monkeypatch.setenv(OVERLAP_ENV, " 64 ")
    assert max_overlap_rows() == 64
    for bad in ("-1", "off", "1.5"):
        monkeypatch.setenv(OVERLAP_ENV, bad)
        with pytest.raises(ValueError, match=f"{OVERLAP_ENV}='{bad}'"):
            max_overlap_rows()


def test_an_engine_refuses_a_bad_value_in_one_line_before_loading(monkeypatch):
    monkeypatch.setenv(OVERLAP_ENV, "many")
    with pytest.raises(ConfigError, match=f"{OVERLAP_ENV}='many'") as e:
        LLM(backend="reference", max_num_seqs=1)
    assert "\n" not in str(e.value)


def test_off_the_gpu_a_chain_runs_at_its_fork_or_deferred_at_its_join(monkeypatch):
    monkeypatch.delenv(DEFER_ENV, raising=False)
    x, ran = torch.randn(4, 8), []
    branch = fork(x, lambda: ran.append("chain") or x * 2)
    ran.append("main")
    assert not overlap_applies(x) and not on_side_stream(x.device) and not branch.overlapped
    assert torch.equal(branch.join(), x * 2) and ran == ["chain", "main"]
    monkeypatch.setenv(DEFER_ENV, "1")  # the other order two streams may take
    ran.clear()
    branch = fork(x, lambda: ran.append("chain") or x * 3)
    ran.append("main")
    assert overlap_applies(x) and branch.overlapped
    assert torch.equal(branch.join(), x * 3) and torch.equal(branch.join(), x * 3)  # runs once
    assert ran == ["main", "chain"]
    ran.clear()
    assert torch.equal(fork(x, lambda: ran.append("chain") or x, enabled=False).join(), x)
    monkeypatch.setenv(OVERLAP_ENV, "3")  # 4 rows: not overlapped
    assert not fork(x, lambda: x).overlapped


def _plain_and_fp8_parts(g: torch.Generator) -> list[tuple[str, object]]:
    """A router-like plain part, then two FP8 parts of 128-row blocks (one matmul together)."""
    router = torch.randn(16, 256, generator=g)
    fp8 = []
    for name in ("gate", "up"):
        data, scale = quant_fp8(torch.randn(128, 256, generator=g) * 0.05)
        fp8.append((name, QuantizedTensor(data, scale, "fp8", (128, 128))))
    return [("router", router), *fp8]


def test_a_fused_projection_gives_any_separable_parts_alone_with_the_same_bits():
    g = torch.Generator().manual_seed(0)
    ops = OpTable.reference()
    mixed = FusedProjection(_plain_and_fp8_parts(g), torch.float32, "mixed")
    x = torch.randn(3, 256, generator=g)
    whole = mixed(x, ops)
    assert mixed.part_count == 3 and len(mixed.groups) == 2
    assert mixed.separable(range(1)) and mixed.separable(range(1, 3)) and not mixed.separable(range(2))
    assert [mixed.matmul_of(p) for p in range(3)] == [0, 1, 1]
    for parts in (range(1), range(1, 3), range(3)):
        got = mixed.project(x, ops, parts)
        assert all(torch.equal(a, whole[p]) for a, p in zip(got, parts, strict=True))
    plain = FusedProjection(
        [("a", torch.randn(4, 256, generator=g)), ("b", torch.randn(6, 256, generator=g))],
        torch.float32,
        "plain",
    )
    assert len(plain.groups) == 1 and not plain.separable(range(1))


@pytest.mark.gpu
def test_gpu_a_branch_runs_on_the_side_stream_and_a_captured_graph_replays_its_bits(monkeypatch):
    """Two chains of matmuls, one on the side stream: eager and replayed in a CUDA graph, the
    results are one stream's bit for bit; the branch's kernels ran on the side stream."""
    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    monkeypatch.delenv(DEFER_ENV, raising=False)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(8, 1024, device=dev, generator=g, dtype=torch.bfloat16)
    w1 = torch.randn(1024, 1024, device=dev, generator=g, dtype=torch.bfloat16) * 0.03
    w2 = torch.randn(1024, 1024, device=dev, generator=g, dtype=torch.bfloat16) * 0.03

    def chains(overlap: bool) -> torch.Tensor:
        seen = []

        def chain() -> torch.Tensor:
            seen.append(on_side_stream(dev))
            return torch.relu(x @ w1) @ w2

        side = fork(x, chain, enabled=overlap)
        b = torch.tanh(x @ w2) @ w1
        out = side.join() + b
        assert seen == [overlap] and side.overlapped == overlap
        return out

    want = chains(False)
    assert torch.equal(chains(True), want)
    assert side_stream(dev) is not None and not on_side_stream(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chains(True)
    x.mul_(0.5)  # new inputs, replayed
    graph.replay()
    torch.cuda.synchronize()
    want = chains(False)
    assert torch.equal(out, want)
    monkeypatch.setenv(OVERLAP_ENV, "4")
    assert not overlap_applies(x)  # 8 rows


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny V4 (plain weights: one input matmul a block), the tiny V4 kept FP8 / FP4 with
    32x32 blocks (the router's and the compressors' matmuls apart from the rest) and the tiny
    V4.1."""
    from deepinfer_core.models.deepseek_v4 import tiny
    from deepinfer_core.models.deepseek_v41 import tiny as tiny41

    out = tmp_path_factory.mktemp("overlap")
    return {
        "v4": str(tiny.builtin_tiny_model_dir()),
        "v4_fp8_fp4": str(
            tiny.make_tiny(out / "q", names="native", fp8_linear=True, fp4_experts=True, fp8_block=(32, 32))
        ),
        "v41": str(tiny41.make_tiny(out / "v41")),
    }


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("model", ["v4", "v4_fp8_fp4", "v41"])
def test_every_branch_deferred_to_its_join_gives_the_same_tokens_and_logprobs(
    models, model, backend, monkeypatch
):
    """Each block's branches (V4 / V4.1: the shared expert, the compressors, the ring write) run
    at their joins instead of their forks: had a block read what a branch computes or writes, or
    changed what it reads, before the join, two streams could give other results, and so does
    this order.  Prefill chunks and decode steps, bit for bit the branches run at their forks."""
    from deepinfer_core import SamplingParams

    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    kw = {"model": models[model], "backend": backend, "max_num_seqs": 3, "max_num_batched_tokens": 64}
    if model == "v4_fp8_fp4":
        kw["keep_quantized"] = True
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
    ids = [[5, 9, 12, 40, 41, 3] * 8, [7, 8, 9], [100 + i for i in range(30)]]
    prompts = [{"prompt_token_ids": p} for p in ids]
    monkeypatch.delenv(DEFER_ENV, raising=False)
    want = LLM(**kw).generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv(DEFER_ENV, "1")
    got = LLM(**kw).generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
