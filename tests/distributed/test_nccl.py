"""Distributed exactness on two GPUs over NCCL: the CPU tests' checks
(``test_dp_ep_engine.py``, ``test_data_parallel.py``, ``test_context_parallel.py``) on CUDA.

The tiny model in fp32 on the best GPU backend (``cuda_sm100`` when available, else the
``reference`` ops on CUDA): ``LLM(data_parallel_size=2, enable_expert_parallel=True)``,
``LLM(data_parallel_size=2)`` and ``LLM(context_parallel_size=2)`` (``DEEPINFER_CP_MIN_TOKENS=64``,
chunks of 128 tokens, prompts of up to 220 tokens, two sharing a 96-token prefix) generate the
greedy tokens and top-3 logprobs of a single-GPU ``LLM``: bitwise with ``batch_invariant=True``
where the backend declares batch invariance on CUDA (``cuda_sm100`` does), else equal tokens and
logprobs within 1e-4.  Every run checks that the default process group is NCCL (``cpu_group``
gloo), that rank 0 runs on ``cuda:0`` and the worker on ``cuda:1`` (its log), that expert
parallelism halves rank 0's experts and that context parallelism split prefill chunks.  The
engines run eagerly (``enforce_eager=True``: the comparison is of the distribution alone, as on
the CPU, where there are no device graphs) except two DP2+EP2 runs with decode graphs, one of
them with EPLB rebalancing every 2 steps (expert weights moved between the GPUs over NCCL).

Skipped unless ``torch.cuda.device_count() >= 2``.  On the 2-GPU H200 kind (NVLink multicast
off: this module sets ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` before any run; the worker ranks inherit them), about a minute or two::

    python3 -m pip install --no-deps --no-build-isolation -e . -e plugins/cuda_sm100
    timeout 300 python3 -m pytest tests/distributed/test_nccl.py -v

``DEEPINFER_NCCL_TEST_ON_CPU=1`` runs the same tests on the CPU over gloo with the reference
backend (a check of the tests themselves where there are no GPUs).
"""

from __future__ import annotations

import os
import time

# NVLink multicast off before any process group exists (/work/.library/device/KINDS.md)
NCCL_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(NCCL_SAFE_ENV)

from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.models.context_parallel import CP_MIN_TOKENS_ENV  # noqa: E402
from deepinfer_core.testing.observe import counting_context_parallel_forwards  # noqa: E402
from tests.distributed.outputs import assert_same_completions  # noqa: E402

CPU_ENV = "DEEPINFER_NCCL_TEST_ON_CPU"
ON_CPU = os.environ.get(CPU_ENV) == "1"
GPUS = torch.cuda.device_count()

pytestmark = pytest.mark.skipif(
    not ON_CPU and GPUS < 2,
    reason=f"needs 2 CUDA GPUs for NCCL (torch sees {GPUS}); {CPU_ENV}=1 runs the tests on the CPU over gloo",
)

CP_MIN = 64  # prompts of 100-220 tokens are split over the CP ranks, short chunks are not
_SHARED = [(5 * j) % 300 + 4 for j in range(96)]  # a prefix two prompts share (prefix-cache hits)
PROMPTS: list[Any] = [
    {"prompt_token_ids": [(7 * i + 3 * j) % 200 + 2 for j in range(40 + 60 * i)]} for i in range(4)
]
PROMPTS += [{"prompt_token_ids": _SHARED + [(11 * j + i) % 90 + 2 for j in range(50)]} for i in range(2)]
PROMPTS += [{"prompt_token_ids": [(13 * i + j) % 150 + 5 for j in range(3 + 5 * i)]} for i in range(6)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
TOLERANCE = 1e-4  # without batch invariance: logprob difference allowed (fp32)

RUNS = {
    "dp2_ep2": {"data_parallel_size": 2, "enable_expert_parallel": True},
    "dp2": {"data_parallel_size": 2},
    "cp2": {"context_parallel_size": 2},
    # decode steps replayed from CUDA graphs with the fixed-shape EP exchange captured in them;
    # the shutdown must release them before NCCL's teardown (it hung otherwise)
    "dp2_ep2_graphs": {"data_parallel_size": 2, "enable_expert_parallel": True, "enforce_eager": False},
    # EPLB rebalancing every 2 steps (2 replicas): expert weights move between the GPUs over NCCL
    # into the stacks the decode graphs read (gpu_distributed.py's eplb part)
    "dp2_ep2_eplb": {
        "data_parallel_size": 2,
        "enable_expert_parallel": True,
        "enforce_eager": False,
        "eplb": {"rebalance_interval": 2, "window_steps": 2, "num_redundant_experts": 2},
    },
}
SHUTDOWN_S = 20.0  # a clean shutdown of a 2-rank run takes about a second


@dataclass(frozen=True)
class Target:
    """Where the runs go: device type, backend, the expected process-group backend, and whether
    the backend declares batch invariance there (then the comparison is bitwise)."""

    device: str
    backend: str
    dist_backend: str
    batch_invariant: bool


@pytest.fixture(scope="module")
def target() -> Target:
    """``cuda_sm100`` when it is available, else the reference ops on CUDA (gloo and the
    reference on the CPU with ``DEEPINFER_NCCL_TEST_ON_CPU=1``)."""
    from deepinfer_core.plugins import get_plugins

    plugins = get_plugins()
    if ON_CPU:
        spec = plugins.get_backend("reference")
        return Target("cpu", "reference", "gloo", "cpu" in spec.batch_invariant_devices)
    assert dist.is_nccl_available(), "torch was built without NCCL"
    spec = plugins.get_backend("reference")
    if "cuda_sm100" in plugins.backends:
        candidate = plugins.get_backend("cuda_sm100")
        ok, reason = candidate.availability()
        if ok:
            spec = candidate
        else:
            print(f"cuda_sm100 is not available ({reason}): the reference ops on CUDA")
    else:
        print("cuda_sm100 is not installed (pip install -e plugins/cuda_sm100): the reference ops on CUDA")
    return Target("cuda", spec.name, "nccl", "cuda" in spec.batch_invariant_devices)


def _options(target: Target) -> dict[str, Any]:
    return {
        "backend": target.backend,
        "device": target.device,
        "dtype": "float32",
        "batch_invariant": target.batch_invariant,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,  # chunked prefill: prompts of up to 220 tokens in CP chunks
        "max_model_len": 256,
        "enforce_eager": True,
        "distributed_timeout_s": 120.0,  # a hung collective fails the test instead of the session
    }


def _outputs(llm: LLM) -> list[Any]:
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for o in outs:
        assert o.error is None, f"request {o.request_id}: {o.error}"
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def single_gpu(tiny_dir: Path, target: Target) -> list[Any]:
    """The single-device outputs every distributed run is compared with."""
    with LLM(model=str(tiny_dir), **_options(target)) as llm:
        device = llm.engine.runner.device
        assert device.type == target.device and device.index in (None, 0), f"single run on {device}"
        return _outputs(llm)


def _check_world(llm: LLM, target: Target, run: str) -> None:
    """The run's process groups and devices: NCCL (gloo for host messages), rank 0 on device 0,
    the worker on device 1 (read from its log)."""
    coordinator = llm.client
    assert coordinator is not None, "a distributed run has a coordinator on rank 0"
    parallel = coordinator.parallel
    assert dist.is_initialized() and dist.get_world_size() == 2
    assert dist.get_backend() == target.dist_backend, f"default group: {dist.get_backend()}"
    assert dist.get_backend(parallel.cpu_group) == "gloo"
    if parallel.ep_group is not None:
        assert dist.get_backend(parallel.ep_group) == target.dist_backend
    if parallel.cp_group is not None:
        assert dist.get_backend(parallel.cp_group) == target.dist_backend
    rank0 = torch.device("cuda", 0) if target.device == "cuda" else torch.device("cpu")
    assert parallel.device == rank0 and llm.engine.runner.device == rank0
    want = f"on {'cuda:1' if target.device == 'cuda' else 'cpu'} (backend {target.dist_backend})"
    log_text = Path(coordinator.logs[1]).read_text(errors="replace")
    assert want in log_text, f"{run}: rank 1's log {coordinator.logs[1]} does not say it runs {want!r}"


@pytest.mark.parametrize("run", list(RUNS))
def test_two_ranks_match_one_device(
    run: str, tiny_dir: Path, target: Target, single_gpu: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP2+EP2 (also with decode graphs, and with EPLB rebalancing), DP2 and CP2 give the single
    device's greedy tokens and logprobs (bitwise with batch invariance), on NCCL, one rank per GPU."""
    monkeypatch.setenv(CP_MIN_TOKENS_ENV, str(CP_MIN))  # read when the model is built; workers inherit it
    options = RUNS[run]
    with LLM(model=str(tiny_dir), **{**_options(target), **options}) as llm:
        _check_world(llm, target, run)
        if not options.get("enforce_eager", True) and target.device == "cuda":
            assert llm.engine.runner.graph_manager.graphs("decode"), "no decode graphs were captured"
        model = llm.engine.runner.model
        moe = model.layers[0].moe
        if options.get("enable_expert_parallel"):  # rank 0 holds half of the routed experts (+ replicas)
            redundant = options.get("eplb", {}).get("num_redundant_experts", 0)
            assert moe.gate_up.shape[0] * 2 == model.cfg.n_routed_experts + redundant
        else:
            assert moe.gate_up.shape[0] == model.cfg.n_routed_experts
        with counting_context_parallel_forwards(model) as split:
            got = _outputs(llm)
        if "eplb" in options:
            assert llm.get_metrics()["eplb"]["rebalances"] >= 1, "EPLB never moved an expert"
        start = time.monotonic()
    assert time.monotonic() - start < SHUTDOWN_S, "the distributed run's shutdown took too long"
    if options.get("context_parallel_size", 1) > 1:
        assert split[0] > 0, "context parallelism never split a prefill chunk"
    else:
        assert split[0] == 0
    assert_same_completions(got, single_gpu, exact=target.batch_invariant, tolerance=TOLERANCE)
