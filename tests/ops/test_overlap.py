"""Side-stream overlap (``deepinfer_core.ops.overlap``): when a block's chains run on two CUDA
streams, that the results are one stream's bit for bit, and how a bad setting is refused."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.deepseek_v4.fused import FusedProjection
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.overlap import (
    DEFAULT_MAX_ROWS,
    OVERLAP_ENV,
    max_overlap_rows,
    no_overlap,
    on_side_stream,
    overlap_applies,
    side_branch,
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


def test_off_the_gpu_a_branch_runs_inline_and_its_join_waits_for_nothing():
    x = torch.randn(4, 8)
    assert not overlap_applies(x) and not on_side_stream(x.device)
    with side_branch(x) as side:
        y = x * 2
    assert not side.overlapped
    side.join()
    side.join()  # a second join is harmless
    assert torch.equal(y, x * 2)


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
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(8, 1024, device=dev, generator=g, dtype=torch.bfloat16)
    w1 = torch.randn(1024, 1024, device=dev, generator=g, dtype=torch.bfloat16) * 0.03
    w2 = torch.randn(1024, 1024, device=dev, generator=g, dtype=torch.bfloat16) * 0.03

    def chains(overlap: bool) -> torch.Tensor:
        with side_branch(x, enabled=overlap) as side:
            seen = on_side_stream(dev)
            a = torch.relu(x @ w1) @ w2
        b = torch.tanh(x @ w2) @ w1
        side.join()
        assert seen == overlap == side.overlapped
        return a + b

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
    with no_overlap():
        assert not overlap_applies(x)
    monkeypatch.setenv(OVERLAP_ENV, "4")
    assert not overlap_applies(x)  # 8 rows
