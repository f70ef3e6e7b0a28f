"""The ascend950 backend's NPU graphs (``deepinfer_ascend950.npu_graph``, the engine's
``graph_runtime`` of device type ``npu``) on the EMULATOR of ``torch_npu.npu``'s graph API,
which replays the recorded device work on the captured tensors (not the Python code): a
captured computation follows new input values, a host read during capture fails, and the
engine serving the tiny model through emulated NPU graphs gives the eager engine's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepinfer_ascend950 import backend
from deepinfer_ascend950.npu_graph import NpuGraph, graph_runtime
from npu_emulator import graphs

from deepinfer_core import SamplingParams
from deepinfer_core.backends import BackendSpec
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.testing import manager_with_plugin


def test_a_replay_reads_the_captured_buffers_new_values(npu_emulator):
    x = torch.randn(4, 8)
    w = torch.randn(8, 3)
    g = NpuGraph(npu_emulator.npu.graph_pool_handle())
    out = g.capture(lambda: torch.relu(x @ w).sum(dim=1) * 2)
    for _ in range(3):
        x.copy_(torch.randn(4, 8))
        assert g.replay() is out
        assert torch.equal(out, torch.relu(x @ w).sum(dim=1) * 2)


def test_a_host_read_during_capture_fails_as_on_the_npu(npu_emulator):
    x = torch.randn(4)
    with pytest.raises(RuntimeError, match="on the host during NPU graph capture"):
        NpuGraph(None).capture(lambda: x * float(x.sum().item()))


def test_the_runtime_is_for_npus_only(npu_emulator):
    factory, pool, why = graph_runtime(torch.device("cpu"))
    assert factory is None and pool is None and "not on device type 'cpu'" in why


class GraphedEmulatedBackend:
    """The ascend950 ops on CPU through the emulator, captured in emulated NPU graphs."""

    @hookimpl
    def deepinfer_register_backends(self, register):
        register(
            BackendSpec(
                name="ascend950_graphs",
                device_type="cpu",
                ops=backend.load_ops,
                supports_graph_capture=True,
                graph_runtime=lambda device: (NpuGraph, graphs.graph_pool_handle(), ""),
            )
        )


def _greedy(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(([5, 6, 7, 8], list(range(10, 30)), [3] * 9)):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: list(o.outputs[0].token_ids) for o in engine.step()}
    return [done[str(i)] for i in range(3)]


@pytest.mark.slow  # two engines, every graph recorded op by op
def test_the_engine_serves_through_emulated_npu_graphs_like_eager(npu_emulator, tiny_v4_dir: Path):
    manager = manager_with_plugin(GraphedEmulatedBackend(), "ascend950_graphs")
    cfg = {"model": str(tiny_v4_dir), "backend": "ascend950_graphs", "max_num_seqs": 4}
    graphs.NPUGraph.replays = 0
    graphed = _greedy(LLMEngine(EngineConfig(**cfg), plugins=manager))
    assert graphs.NPUGraph.replays > 0, "no step replayed an NPU graph"
    eager = _greedy(LLMEngine(EngineConfig(enforce_eager=True, **cfg), plugins=manager))
    assert graphed == eager
