"""Setting up ``torch.distributed`` for a run: the default group, a gloo group for host messages,
the context-parallel groups and the expert-parallel group of :class:`ParallelState`.

The rank layout is the one of :meth:`ParallelState.layout`: ``rank = dp_rank * cp_size +
cp_rank``.  The rendezvous is torchrun's: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` (``LLM(...)`` on one host sets them for the worker
processes it starts itself, see :mod:`deepinfer_core.distributed.launcher`).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.backends.resolve import resolve_backend
from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.errors import ConfigError

if TYPE_CHECKING:
    from deepinfer_core.config import EngineConfig

logger = logging.getLogger("deepinfer.distributed")

RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_DEVICE_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
DESTROY_TIMEOUT_S = 30.0
"""How long :func:`destroy_parallel` waits for the process group's teardown."""
_OWNED = False  # whether init_parallel initialized the default group (and so destroys it)


def launched_by_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is one rank of a launched world (``RANK`` and ``WORLD_SIZE`` set,
    as torchrun sets them), so ``LLM`` must not start workers of its own."""
    env = os.environ if env is None else env
    return "RANK" in env and "WORLD_SIZE" in env


def check_parallel_config(config: EngineConfig) -> None:
    """Refuse the combinations of parallel options the engine cannot run (one-line
    :class:`ConfigError` saying why); called before any process is started."""
    if config.speculative is not None and config.context_parallel_size > 1:
        raise ConfigError(
            f"speculative decoding with context_parallel_size={config.context_parallel_size} is not "
            "supported: its step-time-based draft policy could choose differently on the ranks that "
            "mirror one replica; turn speculative off or use context_parallel_size=1"
        )
    if (
        config.speculative is not None
        and config.speculative.drafter == "mtp"
        and config.enable_expert_parallel
        and config.world_size > 1
    ):
        raise ConfigError(
            "speculative.drafter='mtp' with enable_expert_parallel is not supported: the MTP layer's "
            "extra forwards would not line up with the other ranks' expert-parallel collectives; use "
            "the 'ngram' drafter or turn expert parallelism off"
        )


def device_type_of(config: EngineConfig) -> str:
    """The device type ranks run on: ``config.device``'s, else the selected backend's."""
    if config.device:
        try:
            return torch.device(config.device).type
        except (RuntimeError, ValueError):
            raise ConfigError(f"device={config.device!r}: not a torch device string") from None
    spec, _ = resolve_backend(config.backend, config.strict_ops)
    return spec.device_type


def resolve_dist_backend(name: str, device_type: str) -> str:
    """``distributed_backend`` resolved: ``auto`` = nccl on CUDA, hccl on npu, gloo on CPU."""
    if name != "auto":
        return name
    return _DEVICE_BACKENDS.get(device_type, "gloo")


def rank_device(device_type: str, local_rank: int, configured: str | None) -> torch.device:
    """This rank's device: ``<type>:LOCAL_RANK`` on an accelerator (one device per local rank),
    the CPU as it is."""
    if device_type == "cpu":
        return torch.device("cpu")
    if configured is not None and torch.device(configured).index is not None:
        logger.warning(
            "device=%r ignored in a distributed run: this rank uses %s:%d",
            configured,
            device_type,
            local_rank,
        )
    return torch.device(device_type, local_rank)


def _env_int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name)
    if raw is None:
        raise ConfigError(
            f"environment variable {name} is not set; a distributed rank needs {', '.join(RENDEZVOUS_VARS)} "
            "(torchrun sets them) or LLM(...) without them to start its workers itself"
        )
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r}: expected an integer") from None


def init_parallel(
    config: EngineConfig, env: Mapping[str, str] | None = None, store: Any = None
) -> ParallelState:
    """Join the ``torch.distributed`` world described by ``env`` (default ``os.environ``) and
    build this rank's :class:`ParallelState`.  ``store``: rank 0's rendezvous store, already
    listening (``LLM`` binds it to a free port before it starts the workers), instead of one
    made from ``MASTER_ADDR`` / ``MASTER_PORT``.

    Every rank must call it, with the same parallel options: it creates the groups collectively
    (a gloo ``cpu_group`` when the device backend is not gloo, one CP group per DP replica in
    replica order, the EP group = the world with ``enable_expert_parallel``).

    Raises:
        ConfigError: a rendezvous variable missing or not an integer, ``WORLD_SIZE`` different
            from ``data_parallel_size * context_parallel_size``, ``RANK`` outside the world.
    """
    import torch.distributed as dist

    env = os.environ if env is None else env
    check_parallel_config(config)
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    local_rank = int(env.get("LOCAL_RANK", rank))
    dp, cp = config.data_parallel_size, config.context_parallel_size
    if world != config.world_size:
        raise ConfigError(
            f"WORLD_SIZE={world} but data_parallel_size ({dp}) x context_parallel_size ({cp}) = "
            f"{config.world_size}; launch {config.world_size} processes or change the parallel sizes"
        )
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside the world of WORLD_SIZE={world}")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name):
            _env_int(env, name)  # raises the one-line error naming the variable
    device_type = device_type_of(config)
    backend = resolve_dist_backend(config.distributed_backend, device_type)
    device = rank_device(device_type, local_rank, config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=config.distributed_timeout_s)
    global _OWNED
    if dist.is_initialized():  # the application's own world (torchrun script): used as it is
        if (dist.get_rank(), dist.get_world_size()) != (rank, world):
            raise ConfigError(
                f"torch.distributed is already initialized in this process as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but this run is rank {rank} of {world}; shut the other run "
                "down (LLM.shutdown()) or destroy its process group first"
            )
    else:
        where: dict[str, Any] = (
            {"store": store}
            if store is not None
            else {"init_method": f"tcp://{env['MASTER_ADDR']}:{int(env['MASTER_PORT'])}"}
        )
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **where)
        _OWNED = True
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    layout = ParallelState.layout(rank, dp, cp, config.enable_expert_parallel)
    cp_group = None
    if cp > 1:
        for replica in range(dp):  # every rank creates every group, in the same order
            group = dist.new_group(ranks=list(range(replica * cp, (replica + 1) * cp)), timeout=timeout)
            if replica == layout["dp_rank"]:
                cp_group = group
    ep_group = dist.group.WORLD if layout["ep_size"] > 1 else None
    state = ParallelState(
        **layout,
        device=device,
        device_group=dist.group.WORLD,
        cpu_group=cpu_group,
        cp_group=cp_group,
        ep_group=ep_group,
    )
    logger.info(
        "rank %d of %d: dp %d/%d, cp %d/%d, ep %d/%d on %s (backend %s)",
        rank,
        world,
        state.dp_rank,
        dp,
        state.cp_rank,
        cp,
        state.ep_rank,
        state.ep_size,
        device,
        backend,
    )
    return state


def destroy_parallel(timeout_s: float = DESTROY_TIMEOUT_S) -> bool:
    """Leave the ``torch.distributed`` world that :func:`init_parallel` joined (no-op when not
    in one, or when the application had initialized it itself).

    The teardown runs on a helper thread and is given ``timeout_s`` seconds: a communicator
    teardown that hangs (NCCL with collectives of live CUDA graphs, a peer gone) is logged and
    abandoned instead of hanging the caller.  Returns ``False`` when it timed out (the process
    group stays initialized: a new run in this process is refused with a clear error)."""
    import torch.distributed as dist

    global _OWNED
    if not (dist.is_initialized() and _OWNED):
        return True
    _OWNED = False

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as e:  # a broken world (a rank died): nothing left to tear down cleanly
            logger.debug("destroy_process_group: %s", e)

    if not run_bounded(destroy, timeout_s):
        logger.warning(
            "leaving the torch.distributed world did not finish within %.0f s (a communicator "
            "teardown hung); the process group is abandoned",
            timeout_s,
        )
        return False
    return True


class BackgroundCall:
    """``fn()`` started on a daemon thread; its return value (:attr:`result`) or exception
    (:attr:`error`) kept for the caller, who waits in steps (:meth:`wait`) and may give up.

    Args:
        fn: the call.
        name: the thread's name (shows in stack dumps of a hang).
    """

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._fn = fn
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as e:
            self.error = e

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds: whether the call has ended (returned or raised)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def run_bounded(fn: Callable[[], None], timeout_s: float) -> bool:
    """Run ``fn`` on a daemon thread and wait up to ``timeout_s`` seconds for it: ``True`` when
    it returned in time (its exceptions propagate), ``False`` when it is still running (the
    thread is left behind)."""
    call = BackgroundCall(fn, "deepinfer-bounded")
    if not call.wait(timeout_s):
        return False
    if call.error is not None:
        raise call.error
    return True


def listening_store(world_size: int, timeout_s: float) -> Any:
    """A rendezvous store (rank 0's server) bound to a free port of this host, chosen by the OS
    as it binds: no other process can take the port between choosing and binding it."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def client_store(env: Mapping[str, str], world_size: int, timeout_s: float) -> Any:
    """A client of the rendezvous store at ``MASTER_ADDR:MASTER_PORT`` (a worker ``LLM``
    started: it meets rank 0's :func:`listening_store`)."""
    import torch.distributed as dist

    return dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world_size,
        False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def default_store() -> Any:
    """The rendezvous store of the default group (ranks leave error reports in it), or ``None``."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None
