"""The ``mtp`` drafter's layers: DeepSeek-V4's multi-token-prediction layer run over the
engine's cache (:class:`MtpLayers`), eagerly or as the ``mtp`` graph family."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.contract.step_inputs import StepInputs
from deepinfer_core.models.cache_spec import PagedSpec, PageStateSpec
from deepinfer_core.sampling.transfer import tensor_to_device

from .draft_model import DraftModel


class MtpLayers(DraftModel):
    """The model's MTP layer (``model.mtp``; ``mtp_step_metadata`` / ``mtp_forward``) reading
    the target's hidden states."""

    required_members = ("mtp", "hidden_shape", "mtp_step_metadata", "mtp_forward")
    taps_hidden = True

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        # whether the MTP layer writes paged state (a compressed MTP layer): its draft rows must
        # then stay within a request's allocated pages
        self.paged = any(isinstance(s, PagedSpec | PageStateSpec) for s in runner.cache_specs[-1])
        shape = (runner.config.max_num_seqs, *runner.model.hidden_shape)
        self._in = torch.zeros(shape, dtype=runner.dtype, device=runner.device)  # graphs' input (fixed)

    def execute(
        self, chunks: list[SeqChunk], hidden: torch.Tensor, logit_rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the multi-token-prediction layer.

        ``chunks`` describe its rows as a target step's do (slot, positions, block table,
        ``window_from`` / ``cached_until``), with ``token_ids`` the token *after* each row's
        position (the MTP embeds the next token); ``hidden`` ``[T, *hidden_shape]`` is each
        row's input hidden state (the target's at that position, from ``runner.hidden``, or the
        MTP's own output one position earlier when drafting recursively).  The rows write the
        MTP layer's caches at their positions, rolled back by position like the target's.
        Returns float32 logits of ``logit_rows`` and every row's output hidden state.  Steps of
        one row per request replay the smallest ``mtp`` graph holding them, on padded rows.
        """
        r = self.runner
        bucket = r.graph_manager.bucket("mtp", len(chunks))
        if bucket is not None and all(c.num_tokens == 1 for c in chunks):
            n = len(chunks)
            self._in[:n].copy_(hidden)
            r.inputs.prepare(chunks, list(range(bucket)), None, bucket, bucket + 1, r.max_model_len)
            logits, streams = r.graph_manager.replay("mtp", bucket)
            index = tensor_to_device(torch.tensor(logit_rows, dtype=torch.int64), r.device)  # no sync
            return logits.index_select(0, index), streams[:n].clone()
        return self.forward(r.inputs.prepare(chunks, logit_rows, None), hidden)

    def forward(self, inputs: StepInputs, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Derive an MTP step's plans on the device and run the MTP layer (what a graph records)."""
        model = self.runner.model
        return self.runner.run_step(model.mtp_step_metadata, model.mtp_forward, inputs, hidden)

    def capture_graphs(self, graphs: Any, buckets: list[int]) -> str | None:
        """One ``mtp`` graph per bucket of one-row-per-request steps (the rows' input hidden
        states copied into a fixed buffer first)."""
        r = self.runner
        if self._in.shape[0] < max(buckets):
            self._in = self._in.new_zeros((max(buckets), *self._in.shape[1:]))

        def make(b: int) -> Callable[[], Any]:
            inputs = r.inputs.prepare([], list(range(b)), None, b, b + 1, r.max_model_len)
            return lambda: self.forward(inputs, self._in[:b])

        return graphs.capture_family("mtp", buckets, make, "batch-{} MTP")
