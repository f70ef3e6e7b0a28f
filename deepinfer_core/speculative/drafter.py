"""The drafter interface: propose up to ``k`` next tokens per request from its tokens.

A drafter is a class registered through the ``deepinfer_register_drafters`` hook
(``register(name, factory)``, ``factory()`` returning the class) and selected by
``SpeculativeConfig.drafter``.  The engine builds one instance with ``(config, vocab_size)``
and, before every step, calls :meth:`Drafter.propose` once with the requests that decode
this step; the drafts it returns are verified in that step's forward (see
:mod:`deepinfer_core.engine.speculative`), so a drafter never needs to be right: a wrong
draft only costs the verify work.  :meth:`Drafter.on_finished` says when a request is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

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
    """

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    max_tokens: int


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


class Drafter:
    """Base class of a drafter (see the module docstring).

    Args:
        config: the engine's :class:`~deepinfer_core.config.SpeculativeConfig`.
        vocab_size: the target model's vocabulary size (drafts must be ids below it).
    """

    def __init__(self, config: SpeculativeConfig, vocab_size: int) -> None:
        self.config = config
        self.vocab_size = vocab_size

    def propose(self, contexts: Sequence[DraftContext]) -> list[Draft]:
        """One :class:`Draft` per context, in order."""
        raise NotImplementedError

    def on_finished(self, request_id: str) -> None:
        """The request finished (any reason): drop any state kept for it."""
