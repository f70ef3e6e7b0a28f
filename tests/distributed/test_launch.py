"""Launching a distributed run and its failures, on the built-in tiny model on CPU (gloo):
``torchrun -m deepinfer_core.launch generate ...`` prints what the single-process CLI prints;
a worker that dies or whose engine cannot start ends the run with one ``DistributedError``
naming the rank and its log; bad parallel options and rendezvous variables are one-line
``ConfigError``s; the distributed CLI flags and environment variables reach the config."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.cli import build_parser
from deepinfer_core.cli_engine_args import engine_kwargs
from deepinfer_core.config import EngineConfig
from deepinfer_core.distributed.faults import FAULT_ENV
from deepinfer_core.distributed.init import init_parallel, run_bounded
from deepinfer_core.distributed.processes import LOG_DIR_ENV
from deepinfer_core.errors import ConfigError, DistributedError

ROOT = Path(__file__).resolve().parents[2]
CLI_ARGS = ["--prompt", "hello there", "--prompt", "one two three four", "--prompt", "x"]
CLI_ARGS += ["--max-tokens", "4", "--temperature", "0", "--logprobs", "1", "--json"]
CLI_ARGS += ["--backend", "reference", "--max-num-seqs", "4", "--max-model-len", "128", "--batch-invariant"]
OPTIONS = {"backend": "reference", "max_num_seqs": 4, "max_model_len": 128}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_torchrun_launch_prints_the_single_process_output(tmp_path: Path) -> None:
    want = _run(["-m", "deepinfer_core.cli", "generate", *CLI_ARGS], _env())
    assert want.returncode == 0, want.stderr
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    launch += ["-m", "deepinfer_core.launch", "generate", *CLI_ARGS, "--data-parallel-size", "2"]
    got = _run(launch, _env(DEEPINFER_LOG_DIR=str(tmp_path)))
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout == want.stdout
    assert len(got.stdout.splitlines()) == 3
    log = (tmp_path / "rank1.log").read_text()  # the worker's own log, its lines prefixed
    assert log and all(line.startswith("[rank 1] ") for line in log.splitlines())


def test_dead_worker_ends_the_run_with_one_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:3")  # rank 1 exits (status 17) on its third step
    llm = LLM(**OPTIONS, data_parallel_size=2, distributed_timeout_s=60)
    try:
        prompts = [{"prompt_token_ids": [5 + k] * (3 + k)} for k in range(6)]
        with pytest.raises(DistributedError) as info:  # at once: the driver sees the exit, no timeout
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        msg = str(info.value)
        assert "rank 1 exited with status 17" in msg and "\n" not in msg
        log = msg.split("its log: ")[1].split(" ")[0]
        assert Path(log).name == "rank1.log" and Path(log).is_file()
        lines = Path(log).read_text().splitlines()  # the worker's stdout, stderr and log records
        assert lines and all(line.startswith("[rank 1] ") for line in lines)
        with pytest.raises(DistributedError, match="has ended"):  # the LLM says so from then on
            llm.generate(["hi"], use_tqdm=False)
        for proc in llm.client.procs.values():
            assert proc.poll() is not None  # no worker left behind
    finally:
        llm.shutdown()
        llm.shutdown()  # idempotent
    assert Path(log).is_file()  # a failed run keeps the logs that explain it


def test_a_clean_run_removes_its_temporary_log_dir_and_keeps_a_configured_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for configured in (False, True):
        if configured:
            monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path / "logs"))
        llm = LLM(**OPTIONS, data_parallel_size=2, distributed_timeout_s=60)
        log_dir = Path(llm.client.log_dir)
        try:
            params = SamplingParams(temperature=0, max_tokens=2)
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, params, use_tqdm=False)
            assert (log_dir / "rank1.log").is_file()
        finally:
            llm.shutdown()
        assert log_dir.exists() == configured, (configured, log_dir)
        assert configured == (log_dir == tmp_path / "logs")


@pytest.mark.slow
def test_hung_worker_ends_the_run_after_the_timeout_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:2:hang")  # rank 1 stops answering on its second step
    llm = LLM(**OPTIONS, data_parallel_size=2, distributed_timeout_s=10)
    try:
        with pytest.raises(DistributedError) as info:
            llm.generate(["a b c", "d e"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        msg = str(info.value)
        assert msg.startswith("rank 1 did not finish step 2 (the last it finished: 1)") and "\n" not in msg
        assert "timed out (distributed_timeout_s)" in msg and "rank1.log" in msg
        procs = llm.client.procs.values()
        assert all(proc.poll() is not None for proc in procs)  # the hung worker was stopped
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_worker_engine_failure_reaches_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "2:0")  # rank 2's engine fails to start
    with pytest.raises(DistributedError) as info:
        LLM(**OPTIONS, data_parallel_size=3, distributed_timeout_s=60)
    msg = str(info.value)
    assert msg.startswith("rank 2: the engine failed to start: RuntimeError: engine start failure injected")
    assert "rank2.log" in msg


def test_world_size_mismatch_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=r"^WORLD_SIZE=3 but data_parallel_size \(2\)") as info:
        LLM(**OPTIONS, data_parallel_size=2)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_world_size_mismatch_under_launch_is_one_line() -> None:
    env = _env(RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    got = _run(
        ["-m", "deepinfer_core.launch", "generate", "--prompt", "hi", "--data-parallel-size", "2"], env
    )
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [
        "error: WORLD_SIZE=3 (torchrun --nproc-per-node x --nnodes) but data_parallel_size (2) x "
        "context_parallel_size (1) = 2; make them equal, or leave data_parallel_size out to take it "
        "from WORLD_SIZE"
    ]


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]


@pytest.mark.slow
def test_torchrun_without_data_parallel_size_takes_the_world_size(tmp_path: Path) -> None:
    """``--nproc-per-node 2`` and no ``--data-parallel-size``: two replicas (twice one
    process's KV cache capacity), the single-process output."""
    args = ["generate", *CLI_ARGS, "--verbose"]
    want = _run(["-m", "deepinfer_core.cli", *args], _env())
    assert want.returncode == 0, want.stderr
    got = _run([*TORCHRUN, "2", "-m", "deepinfer_core.launch", *args], _env(DEEPINFER_LOG_DIR=str(tmp_path)))
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout == want.stdout

    def capacity(stderr: str) -> int:
        return int(stderr.split("KV cache capacity: ")[1].split(" tokens")[0])

    assert capacity(got.stderr) == 2 * capacity(want.stderr)
    assert (tmp_path / "rank1.log").is_file()  # rank 1 served the run


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "flags", "error"),
    [
        (
            "2",
            ["--data-parallel-size", "3"],
            "error: WORLD_SIZE=2 (torchrun --nproc-per-node x --nnodes) but data_parallel_size (3) x "
            "context_parallel_size (1) = 3; make them equal, or leave data_parallel_size out to take it "
            "from WORLD_SIZE",
        ),
        (
            "3",
            ["--context-parallel-size", "2"],
            "error: WORLD_SIZE=3 (torchrun --nproc-per-node x --nnodes) is not a multiple of "
            "context_parallel_size (2); launch a multiple of 2 processes",
        ),
        (
            "2",
            ["--max-tokens", "x"],
            "error: deepinfer generate: argument --max-tokens: invalid int value: 'x'; "
            "see 'deepinfer generate --help'",
        ),
    ],
)
def test_torchrun_refusal_is_one_line_and_a_clean_exit(nproc: str, flags: list[str], error: str) -> None:
    """Under torchrun a refused run prints one ``error:`` line (local rank 0's) and every rank
    exits 0, so torchrun adds no traceback of its own."""
    got = _run(
        [*TORCHRUN, nproc, "-m", "deepinfer_core.launch", "generate", "--prompt", "hi", *flags], _env()
    )
    assert (got.returncode, got.stdout) == (0, "")
    assert got.stderr.splitlines() == [error]


def test_missing_rendezvous_variable_is_named() -> None:
    config = EngineConfig(data_parallel_size=2)
    with pytest.raises(ConfigError, match="environment variable MASTER_PORT is not set"):
        init_parallel(config, {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    with pytest.raises(ConfigError, match=r"RANK='x': expected an integer"):
        init_parallel(config, {"RANK": "x", "WORLD_SIZE": "2"})


def test_refused_combinations_say_why() -> None:
    with pytest.raises(ConfigError, match="speculative decoding with context_parallel_size=2"):
        LLM(**OPTIONS, context_parallel_size=2, speculative={"drafter": "ngram"})
    with pytest.raises(ConfigError, match="drafter='mtp' with enable_expert_parallel"):
        LLM(**OPTIONS, data_parallel_size=2, enable_expert_parallel=True, speculative={"drafter": "mtp"})


def test_cli_flags_and_env_reach_the_config() -> None:
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--data-parallel-size", "2", "--enable-expert-parallel"]
        + ["--context-parallel-size", "2", "--distributed-backend", "gloo", "--distributed-timeout-s", "30"]
        + ["--eplb", '{"window_steps": 10, "rebalance_interval": 20}']
    )
    config = EngineConfig.load(env={}, **engine_kwargs(args))
    assert (config.data_parallel_size, config.context_parallel_size, config.world_size) == (2, 2, 4)
    assert config.enable_expert_parallel and config.distributed_backend == "gloo"
    assert config.distributed_timeout_s == 30.0 and config.eplb is not None and config.eplb.window_steps == 10
    env = {"DEEPINFER_DATA_PARALLEL_SIZE": "4", "DEEPINFER_ENABLE_EXPERT_PARALLEL": "1"}
    env |= {"DEEPINFER_EPLB": '{"num_redundant_experts": 4}', "DEEPINFER_DISTRIBUTED_TIMEOUT_S": "5"}
    config = EngineConfig.load(env=env)
    assert config.world_size == 4 and config.enable_expert_parallel and config.eplb.num_redundant_experts == 4
    assert config.distributed_timeout_s == 5.0


def test_bounded_teardown_returns_in_time_and_gives_up_on_a_hang() -> None:
    """``run_bounded`` (how ``destroy_parallel`` leaves the world): a call that returns gives
    ``True`` and its exception propagates; a call that hangs gives ``False`` after the timeout
    instead of hanging the caller."""
    done: list[int] = []
    assert run_bounded(lambda: done.append(1), 5.0) and done == [1]
    with pytest.raises(ZeroDivisionError):
        run_bounded(lambda: 1 / 0, 5.0)
    release = threading.Event()
    start = time.monotonic()
    assert not run_bounded(release.wait, 0.3)
    assert 0.3 <= time.monotonic() - start < 5.0
    release.set()
