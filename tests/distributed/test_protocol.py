"""The step protocol's host messages (``protocol.broadcast`` / ``gather`` over gloo): a
message or reply that pickles to at most ``FAST_BYTES`` travels in one fixed-size frame, a
larger one in a second collective; either way every rank gets rank 0's message and rank 0
every rank's reply, in rank order, equal to what was sent."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.distributed.protocol import FAST_BYTES, StepMessage, broadcast, gather


def _messages(rank: int, round_: int) -> tuple[StepMessage, dict]:
    """Round ``round_``'s message (rank 0's) and ``rank``'s reply: small, large from one rank
    only, large from all."""
    big = "x" * (2 * FAST_BYTES)
    msg = StepMessage(aborts=[big] if round_ == 2 else [f"r{round_}"])
    large = round_ == 2 or (round_ == 1 and rank == 1)
    return msg, {"rank": rank, "round": round_, "outputs": [big] if large else []}


def _worker(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        parallel = ParallelState(rank=rank, world_size=world, cpu_group=dist.group.WORLD)
        for round_ in range(3):
            msg, reply = _messages(rank, round_)
            got = broadcast(msg if rank == 0 else None, parallel)
            assert got == msg, (rank, round_)
            replies = gather(reply, parallel)
            if rank == 0:
                assert replies == [_messages(r, round_)[1] for r in range(world)], round_
            else:
                assert replies is None
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_messages_and_replies_arrive_whole_small_or_large(world: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store")), nprocs=world, join=True)
