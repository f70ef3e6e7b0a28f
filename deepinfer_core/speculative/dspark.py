"""The ``dspark`` drafter: DeepSeek-V4.1's DSpark block drafter (``mtp.{j}.*``).

The model (:mod:`deepinfer_core.models.deepseek_v41.dspark`) keeps the drafter's context keys
in step with the target by itself: the target's forward writes them for every row it computes,
with the target's own ring plan, so rejected drafts leave no trace and the drafter observes
nothing (steps without drafts stay asynchronous).  :meth:`DSparkDrafter.propose` runs one
batched block per call -- ``γ = dspark_block_size`` rows per request, the anchor (the request's
last token, at position ``P``) then the noise token, all rows at once
(:meth:`~deepinfer_core.speculative.dspark_layers.DSparkLayers.execute`) -- then the Markov
walk, one position at a time on the device:

* draft ``k`` (position ``P + k``) is drawn from ``U_{k-1} + W2 W1[x_{k-1}]``, ``x_0`` the anchor;
* greedy requests take the argmax of those logits after the request's own logit processing
  (penalties, bans, bias: :class:`~deepinfer_core.sampling.sampler.Sampler`, as the verifier);
* sampled requests with ``match`` acceptance draw with the verifier's counter-based noise of
  the same ``(seed, position)``, so a draft equals the target's own draw wherever the two
  distributions agree; with ``rejection`` acceptance the noise is independent
  (``derive_seed(seed, DRAFT_SALT)``) and :attr:`Draft.probs` is the distribution drawn from;
* :attr:`Draft.confidence` is the confidence head's conditional ``c_k`` per draft (the engine
  multiplies them into prefix survival probabilities), or ``None`` without the head.

The block always runs all ``γ`` rows (they attend to each other); more than ``γ`` drafts per
step are not possible, so ``max_draft_tokens > γ`` proposes ``γ`` (logged once).  A context
without a sequence slot (``DraftContext.seq_slot < 0``: no cache to read) gets no drafts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.errors import ConfigError
from deepinfer_core.sampling.batch import SamplingBatch
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.random import derive_seed
from deepinfer_core.sampling.sampler import Sampler

from .drafter import Draft, DraftContext, Drafter, RowView
from .dspark_layers import DSparkLayers

logger = logging.getLogger("deepinfer.engine")

DRAFT_SALT = 0xD5_9A_4C
"""Mixed into a request's seed for its drafts' noise under ``rejection`` acceptance (independent
of the verifier's)."""


class DSparkDrafter(Drafter):
    """DeepSeek-V4.1's DSpark block drafter (see the module docstring)."""

    uses_mtp_layers = True
    mtp_kind = "dspark"
    draft_model = DSparkLayers

    def __init__(self, config: Any, vocab_size: int) -> None:
        super().__init__(config, vocab_size)
        self.runner: Any = None
        self.layers: Any = None  # the runner's DSparkLayers
        self.head: Any = None
        self.sampler = Sampler()
        self.eos_token_ids: list[int] = []

    def bind(self, runner: Any) -> None:
        layers = getattr(runner, "draft_model", None)
        if not isinstance(layers, DSparkLayers):
            raise ConfigError(
                "speculative.drafter='dspark' needs a DeepSeek-V4.1 model runner built with its DSpark "
                "draft layers (ModelRunner.load(mtp=True, draft_model=DSparkLayers))"
            )
        head = layers.head
        self.runner, self.layers, self.head = runner, layers, head
        self.sampler = Sampler(runner.ops)  # the runner's backend picks greedy drafts (argmax_rows)
        self.eos_token_ids = list(runner.model_config.eos_token_ids)
        if self.config.max_draft_tokens > head.block_size:
            logger.info(
                "speculative.drafter='dspark': max_draft_tokens=%d, but a DSpark block drafts at most "
                "dspark_block_size=%d tokens per step",
                self.config.max_draft_tokens,
                head.block_size,
            )

    def propose(self, contexts: Sequence[DraftContext]) -> list[Draft]:
        drafts = [Draft([]) for _ in contexts]
        live = [i for i, c in enumerate(contexts) if c.seq_slot >= 0 and len(c.token_ids) >= 1]
        if not live:
            return drafts
        head, gamma = self.head, self.head.block_size
        noise = head.noise_token_id
        chunks = []
        for i in live:
            c = contexts[i]
            anchor = len(c.token_ids) - 1
            chunks.append(
                SeqChunk(
                    c.seq_slot,
                    [int(c.token_ids[-1])] + [noise] * (gamma - 1),
                    anchor,
                    [],
                    window_from=c.window_from,
                )
            )
        u, y = self.layers.execute(chunks)
        b = len(live)
        u, y = u.view(b, gamma, -1), y.view(b, gamma, -1)
        n = min(gamma, max(contexts[i].max_tokens for i in live))
        dev = u.device
        prev = torch.tensor([int(contexts[i].token_ids[-1]) for i in live], dtype=torch.int64).to(dev)
        ctxs = [contexts[i] for i in live]
        rejection = getattr(self.config, "acceptance", "match") == "rejection"
        first = self._batch(ctxs, [[] for _ in live], 1, rejection).prepare(dev, u.shape[-1])
        if not rejection and first.plain_greedy:
            drawn, confs, probs = self._walk_argmax(u, y, prev, n)
        else:
            drawn, confs, probs = self._walk_sampled(u, y, prev, n, ctxs, first, rejection)
        conf_rows = torch.stack(confs, dim=1).tolist() if confs else None
        prob_rows = torch.stack(probs, dim=1) if probs else None
        for j, i in enumerate(live):
            m = min(n, contexts[i].max_tokens)
            drafts[i] = Draft(
                drawn[j][:m],
                confidence=None if conf_rows is None else conf_rows[j][:m],
                probs=None if prob_rows is None else prob_rows[j, :m],
            )
        return drafts

    def _walk_argmax(
        self, u: torch.Tensor, y: torch.Tensor, prev: torch.Tensor, n: int
    ) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
        """The Markov walk when every request is greedy and its logits unprocessed (no penalty,
        mask, bias or ban: :attr:`SamplingTensors.plain_greedy`, what the verifier's sampler
        then does is the argmax, the op table's ``argmax_rows``): all ``n`` positions on the
        device, one read-back."""
        head, steps, confs = self.head, [], []
        argmax_rows = self.sampler.ops.argmax_rows
        for k in range(1, n + 1):
            e, bias = head.markov(prev)
            conf = head.confidence(y[:, k - 1], e)
            if conf is not None:
                confs.append(conf)
            prev = argmax_rows(u[:, k - 1] + bias)
            steps.append(prev)
        return torch.stack(steps, dim=1).tolist(), confs, []

    def _walk_sampled(
        self,
        u: torch.Tensor,
        y: torch.Tensor,
        prev: torch.Tensor,
        n: int,
        ctxs: list[DraftContext],
        first: Any,
        rejection: bool,
    ) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
        """The Markov walk through the engine's sampler, position by position: each draft drawn
        as the verifier draws the token there (the request's penalties, bans, bias, its
        output extended by the drafts before; ``first``: the prepared rows of draft 1)."""
        head = self.head
        drawn: list[list[int]] = [[] for _ in ctxs]
        confs: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for k in range(1, n + 1):
            e, bias = head.markov(prev)
            logits = u[:, k - 1] + bias
            conf = head.confidence(y[:, k - 1], e)
            if conf is not None:
                confs.append(conf)
            batch = (
                first if k == 1 else self._batch(ctxs, drawn, k, rejection).prepare(u.device, logits.shape[1])
            )
            prev = self.sampler(logits, batch).token_ids.to(torch.int64)
            if rejection:
                probs.append(self.sampler.distribution(logits, batch))
            for j, t in enumerate(prev.tolist()):
                drawn[j].append(t)
        return drawn, confs, probs

    def _batch(
        self, contexts: list[DraftContext], drawn: list[list[int]], k: int, rejection: bool
    ) -> SamplingBatch:
        """The sampling rows of draft ``k``: each request as the verifier's row for position
        ``P + k`` sees it (its output extended by drafts ``1 .. k-1``), keyed by that position;
        under ``rejection`` with the request's seed salted (independent noise)."""
        rows, positions = [], []
        for c, d in zip(contexts, drawn, strict=True):
            params = c.params if c.params is not None else SamplingParams(temperature=0.0)
            seed = derive_seed(c.sampling_seed, DRAFT_SALT) if rejection else c.sampling_seed
            tokens = list(c.token_ids)
            out = tokens[c.num_prompt_tokens :] + d
            rows.append(RowView(params, seed, tokens[: c.num_prompt_tokens], out))
            positions.append(len(tokens) - 1 + k)
        eos = contexts[0].eos_token_ids or self.eos_token_ids  # the engine's, else the model's
        batch = SamplingBatch.from_requests(rows, eos, positions)
        batch.num_logprobs = None  # drafts need no logprobs
        return batch
