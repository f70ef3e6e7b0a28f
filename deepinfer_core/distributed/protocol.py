"""The wire protocol of a distributed run's lockstep: what rank 0 broadcasts each step
(:class:`StepMessage`, its :class:`AddRequest` s), how a message and the ranks' replies travel
over the gloo ``cpu_group`` (:func:`broadcast`, :func:`gather`: one fixed-size collective when
they pickle small), and the rendezvous-store keys a rank leaves for rank 0's diagnosis
(:func:`store_key`, :func:`report_error`).
"""

from __future__ import annotations

import contextlib
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.contract.parallel import ParallelState

from .init import default_store

if TYPE_CHECKING:
    from deepinfer_core.sampling.params import SamplingParams

# keys in the rendezvous store, under deepinfer/<run id>/ (a torchrun store outlives one run):
ERROR_KEY = "error/"  # + rank: a rank's last words
STEP_KEY = "step/"  # + rank: the last step message the rank handled


@dataclass
class AddRequest:
    """One request (one sample) for a replica, with the arguments of ``LLMEngine.add_request``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    sample_index: int
    seed_index: int


@dataclass
class StepMessage:
    """What rank 0 broadcasts each global step."""

    adds: list[tuple[int, AddRequest]] = field(default_factory=list)  # (replica, request)
    aborts: list[str] = field(default_factory=list)
    abort_all: str | None = None  # finish every request with this reason instead of stepping
    reset_metrics: bool = False  # zero every rank's metrics instead of stepping
    shutdown: bool = False


FAST_BYTES = 8192
"""Messages and replies up to this many pickled bytes travel in one fixed-size ``uint8``
collective (a step message without requests, a reply without finished outputs); larger ones
take a second collective.  The object collectives of ``torch.distributed`` exchange sizes
first: two to four gloo round trips where one does (~1.1 ms a step on a 2-core CPU before)."""
_HEADER = 8  # the payload's length, little-endian


def _frame(obj: Any) -> tuple[torch.Tensor, bytes]:
    """A ``FAST_BYTES + 8`` frame: the pickled ``obj``'s length, then the pickle when it fits
    (else only the length); and the pickle."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    frame = torch.zeros(_HEADER + FAST_BYTES, dtype=torch.uint8)
    body = len(payload).to_bytes(_HEADER, "little") + (payload if len(payload) <= FAST_BYTES else b"")
    frame[: len(body)] = _tensor_of(body)
    return frame, payload


def _tensor_of(data: bytes) -> torch.Tensor:
    """``data`` as a ``uint8`` tensor (a copy: gloo may write into what it is given)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _length(frame: torch.Tensor) -> int:
    """The payload length a frame's header gives."""
    return int.from_bytes(frame[:_HEADER].numpy().tobytes(), "little")


def _unpickle(data: torch.Tensor) -> Any:
    """The object a ``uint8`` tensor holds pickled."""
    return pickle.loads(data.numpy().tobytes())


def broadcast(msg: Any, parallel: ParallelState) -> Any:
    """Rank 0's ``msg`` on every rank (over the gloo ``cpu_group``; one collective when it
    pickles to at most :data:`FAST_BYTES`)."""
    import torch.distributed as dist

    group = parallel.cpu_group
    if parallel.is_driver:
        frame, payload = _frame(msg)
    else:
        frame, payload = torch.zeros(_HEADER + FAST_BYTES, dtype=torch.uint8), b""
    dist.broadcast(frame, src=0, group=group)
    n = _length(frame)
    if n <= FAST_BYTES:
        return msg if parallel.is_driver else _unpickle(frame[_HEADER : _HEADER + n])
    big = _tensor_of(payload) if parallel.is_driver else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(big, src=0, group=group)
    return msg if parallel.is_driver else _unpickle(big)


def gather(obj: Any, parallel: ParallelState) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (in rank order), ``None`` elsewhere (one all-gather of
    fixed-size frames; a second, padded to the largest, when any pickles to more than
    :data:`FAST_BYTES`)."""
    import torch.distributed as dist

    group = parallel.cpu_group
    frame, payload = _frame(obj)
    frames = [torch.empty_like(frame) for _ in range(parallel.world_size)]
    dist.all_gather(frames, frame, group=group)
    lengths = [_length(f) for f in frames]
    longest = max(lengths)
    bigs: list[torch.Tensor] = []
    if longest > FAST_BYTES:  # every rank sees the lengths: all take the second round
        mine = torch.zeros(longest, dtype=torch.uint8)
        if len(payload) > FAST_BYTES:
            mine[: len(payload)] = _tensor_of(payload)
        bigs = [torch.empty_like(mine) for _ in range(parallel.world_size)]
        dist.all_gather(bigs, mine, group=group)
    if not parallel.is_driver:
        return None
    out = []
    for k, (f, n) in enumerate(zip(frames, lengths, strict=True)):
        data = f[_HEADER : _HEADER + n] if n <= FAST_BYTES else bigs[k][:n]
        out.append(obj if k == parallel.rank else _unpickle(data))
    return out


def store_key(run_id: str, what: str, rank: int) -> str:
    """The rendezvous-store key of ``what`` (:data:`ERROR_KEY`, :data:`STEP_KEY`) of ``rank``."""
    return f"deepinfer/{run_id}/{what}{rank}"


def report_error(parallel: ParallelState | None, text: str, run_id: str) -> None:
    """Leave ``text`` in the rendezvous store for rank 0 (best effort): the cause it names
    when a collective with this rank fails."""
    store = default_store()
    if store is None or parallel is None:
        return
    with contextlib.suppress(Exception):
        store.set(store_key(run_id, ERROR_KEY, parallel.rank), text[-2000:])
