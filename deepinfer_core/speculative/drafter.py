"""The drafter interface: propose up to ``k`` next tokens per request from its tokens.

A drafter is a class registered through the ``deepinfer_register_drafters`` hook
(``register(name, factory)``, ``factory()`` returning the class) and selected by
``SpeculativeConfig.drafter``.  The engine builds one instance with ``(config, vocab_size)``
and, before every step, calls :meth:`Drafter.propose` once with the requests that decode
this step; the drafts it returns are verified in that step's forward (see
:mod:`deepinfer_core.engine.speculative`), so a drafter never needs to be right: a wrong
draft only costs the verify work.  :meth:`Drafter.on_finished` says when a request is done.

A drafter that follows the target's computation overrides :meth:`Drafter.observe`: after
every step the engine tells it which positions each request computed and kept
(:class:`ComputedChunk`).  One that runs layers of its own names their
:class:`~deepinfer_core.speculative.draft_model.DraftModel` in :attr:`Drafter.draft_model`: the
engine builds it with the model runner (the model members it needs checked, its graph families
captured, the target's hidden states of every step kept when it taps them) and hands the runner,
``runner.draft_model`` included, to :meth:`Drafter.bind` before the first step.  One whose
layers are the checkpoint's own draft layers (the core's ``mtp`` and ``dspark``) also sets
:attr:`Drafter.uses_mtp_layers`: the runner then loads them (``ModelFamily.load_mtp_weights``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .draft_model import DraftModel

if TYPE_CHECKING:
    from deepinfer_core.config import SpeculativeConfig


@dataclass
class DraftContext:
    """What a drafter sees of one request.

    Attributes:
        request_id: the request's id.
        token_ids: prompt + output tokens so far (the last one is the token the step decodes).
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        max_tokens: most draft tokens worth proposing (the config's ``max_draft_tokens``, fewer
            near ``max_tokens`` / ``max_model_len``); at least 1.
        seq_slot: the request's sequence slot in the runner's caches (``-1``: not given), for a
            drafter that reads them (``dspark``).
        window_from: first position whose window keys exist for that slot (as
            :attr:`~deepinfer_core.contract.batch.SeqChunk.window_from`).
        params: the request's :class:`~deepinfer_core.sampling.params.SamplingParams`
            (``None``: greedy), for a drafter that draws as the verifier does.
        sampling_seed: the request's sampling seed (the verifier's counter-based noise key).
        eos_token_ids: the engine's EOS ids (model and tokenizer), which the verifier bans while
            the request's ``min_tokens`` is not reached.
    """

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    max_tokens: int
    seq_slot: int = -1
    window_from: int = 0
    params: Any = None
    sampling_seed: int = 0
    eos_token_ids: Sequence[int] = ()


@dataclass
class Draft:
    """A drafter's proposal for one request.

    Attributes:
        token_ids: the proposed next tokens, at most ``DraftContext.max_tokens`` (may be empty).
        confidence: optional per-token estimate of ``P(token i accepted | tokens < i accepted)``
            in ``[0, 1]`` (a confidence head); ``None`` = the engine uses the request's running
            acceptance statistics instead (DSpark scheduling).
        probs: optional ``[len(token_ids), V]`` float tensor, the drafter's distribution each
            token was drawn from (``rejection`` acceptance); ``None`` = deterministic drafts
            (a one-hot distribution).
    """

    token_ids: list[int] = field(default_factory=list)
    confidence: list[float] | None = None
    probs: torch.Tensor | None = None


@dataclass
class ComputedChunk:
    """The positions one request computed in a step and kept (:meth:`Drafter.observe`).

    Attributes:
        request_id: the request's id.
        start_pos: position of the chunk's first row.
        token_ids: for each kept position ``start_pos + i``, the token at the *next* position
            (the prompt's next token, an accepted draft, or the token the step emitted); the
            kept positions are ``start_pos .. start_pos + len(token_ids) - 1`` (a verify step's
            rejected drafts are not among them).
        hidden_row: the row of ``start_pos`` in the hidden states of the step (``hidden``); the
            kept positions follow it.
        sampled: the last kept position is the request's last computed one and its next token
            the one the step emitted: the request decodes from there next step.
        seq_slot, block_table, table_key, window_from, cached_until: the request's cache
            geometry, as in its :class:`~deepinfer_core.contract.batch.SeqChunk` (for a drafter
            that runs layers over the engine's cache).
        hidden: the step's hidden states, one row per token in the step's row order (with
            a draft model that taps them: ``ModelRunner.last_hidden`` of that step; with async scheduling
            a step is observed after the next one was launched, so ``ModelRunner.hidden`` may
            already hold the next step's rows); ``None`` without.
    """

    request_id: str
    start_pos: int
    token_ids: list[int]
    hidden_row: int
    sampled: bool
    seq_slot: int
    block_table: list[int]
    table_key: tuple[str, int]
    window_from: int = 0
    cached_until: int = 0
    hidden: Any = None

    @property
    def num_rows(self) -> int:
        """Kept positions."""
        return len(self.token_ids)


class Drafter:
    """Base class of a drafter (see the module docstring).

    Args:
        config: the engine's :class:`~deepinfer_core.config.SpeculativeConfig`.
        vocab_size: the target model's vocabulary size (drafts must be ids below it).
    """

    draft_model: ClassVar[type[DraftModel] | None] = None
    """The drafter's own layers, built with the model runner as ``runner.draft_model`` (see
    :mod:`~deepinfer_core.speculative.draft_model`); ``None``: the drafter runs no layers."""

    uses_mtp_layers: ClassVar[bool] = False
    """The drafter's layers are the checkpoint's draft layers (multi-token prediction, DSpark):
    the engine loads them into the model runner (a one-line ``ConfigError`` when the checkpoint
    has none)."""

    mtp_kind: ClassVar[str] = "mtp"
    """With :attr:`uses_mtp_layers`: which draft layers it runs, ``"mtp"`` (DeepSeek-V4's MTP
    layer) or ``"dspark"`` (DeepSeek-V4.1's DSpark block drafter); the engine refuses a model
    family whose ``ModelFamily.mtp_kind`` differs (one-line ``ConfigError``)."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int) -> None:
        self.config = config
        self.vocab_size = vocab_size

    def bind(self, runner: Any) -> None:
        """Called once before the first step with the engine's
        :class:`~deepinfer_core.engine.model_runner.ModelRunner`, its ``draft_model`` the
        instance of :attr:`draft_model`."""

    def propose(self, contexts: Sequence[DraftContext]) -> list[Draft]:
        """One :class:`Draft` per context, in order."""
        raise NotImplementedError

    def observe(self, chunks: Sequence[ComputedChunk]) -> None:
        """After every step (its tokens appended, its rejected drafts rolled back): the
        positions each still-running request computed and kept.  Called only for drafters
        that override it."""

    def on_finished(self, request_id: str) -> None:
        """The request finished (any reason): drop any state kept for it."""


@dataclass
class RowView:
    """A request as one verified position sees it: its output extended by the drafts before
    (a :class:`~deepinfer_core.sampling.batch.SamplingRow`; the ``dspark`` drafter draws its
    drafts on the same rows)."""

    params: Any
    sampling_seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)
