"""The ``dspark`` drafter's layers: DeepSeek-V4.1's DSpark block run over the engine's cache
(:class:`DSparkLayers`), eagerly or as the ``dspark`` graph family."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.contract.step_inputs import StepInputs

from .draft_model import DraftModel

logger = logging.getLogger("deepinfer.engine")


class DSparkLayers(DraftModel):
    """The model's DSpark head (``model.dspark``; ``dspark_step_metadata`` /
    ``dspark_forward``).  The target's forward writes the drafter's context itself: no hidden
    states are tapped."""

    required_members = ("dspark", "dspark_step_metadata", "dspark_forward")

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.head = runner.model.dspark

    def execute(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """One DSpark block step: each chunk is one request's block, ``token_ids`` = the anchor
        then noise tokens, ``start_pos`` = the anchor's position, ``seq_slot`` / ``window_from``
        the request's (no pages are read: ``block_table`` may be empty).  Returns every row's
        float32 base logits ``[T, V]`` and collapsed hidden ``[T, D]`` (``Model.dspark_forward``);
        no request's cache is written.  A step of whole blocks replays the smallest captured
        ``dspark`` graph holding its requests, else runs eagerly."""
        r = self.runner
        n = sum(c.num_tokens for c in chunks)
        gamma = self.head.block_size
        bucket = r.graph_manager.bucket("dspark", len(chunks))
        if bucket is not None and all(c.num_tokens == gamma for c in chunks):  # padded to the bucket
            t = bucket * gamma
            r.inputs.prepare(chunks, list(range(t)), None, t, bucket + 1, r.max_model_len, block_tables=False)
            logits, hidden = r.graph_manager.replay("dspark", bucket)
            return logits[:n], hidden[:n]
        return self.forward(r.inputs.prepare(chunks, list(range(n)), None, block_tables=False))

    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Derive a block step's plans on the device and run the block (what a graph records)."""
        model = self.runner.model
        return self.runner.run_step(model.dspark_step_metadata, model.dspark_forward, inputs)

    def capture_graphs(self, graphs: Any, buckets: list[int]) -> str | None:
        """One ``dspark`` graph per bucket of block steps (``dspark_block_size`` rows per
        request, padded to the bucket on the trash slot), all or none.  A failure leaves the
        block steps eager (logged); the target's graphs are kept."""
        r, gamma = self.runner, self.head.block_size

        def make(b: int) -> Callable[[], Any]:
            t = b * gamma
            inputs = r.inputs.prepare([], list(range(t)), None, t, b + 1, r.max_model_len, block_tables=False)
            return functools.partial(self.forward, inputs)

        sizes = [b for b in buckets if b * gamma <= r.inputs.max_tokens]
        error = graphs.capture_family("dspark", sizes, make, "batch-{} DSpark", tokens=gamma)
        if error is not None:
            logger.warning("DSpark block graphs off: %s", error)
        return None
