"""Verify-length policies: how many of each request's drafts a step verifies.

A policy is a :class:`VerifyPolicy` subclass registered through the
``deepinfer_register_verify_policies`` hook (``register(name, factory)``, ``factory()``
returning the class) and chosen by ``SpeculativeConfig.method``; the engine builds it once with
the speculative config and asks it for the lengths of every step that drafts.  The core's:
``fixed`` (every draft, :func:`~deepinfer_core.speculative.policy.fixed_lengths`) and ``dspark``
(confidence-scheduled against the measured step cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from .policy import dspark_lengths, fixed_lengths, uniform_lengths

if TYPE_CHECKING:
    from .step_cost import StepCost


class VerifyPolicy:
    """Base class of a verify-length policy (see the module docstring).

    Args:
        config: the engine's :class:`~deepinfer_core.config.SpeculativeConfig`.
    """

    uses_step_cost: ClassVar[bool] = False
    """The policy weighs drafts against the step cost: the engine then profiles it at start,
    asks the drafter only on steps where drafting is expected to pay (and now and then on
    others, verifying every draft, to keep the estimates measured), and hands :meth:`lengths`
    the drafts' estimated acceptance and the cost."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def lengths(
        self,
        proposed: Sequence[int],
        budget: int,
        confidences: list[list[float]] | None,
        cost: StepCost | None,
        causal: bool,
    ) -> list[int]:
        """Drafts to verify per request (at most ``proposed[i]``, ``budget`` tokens in all).

        Args:
            proposed: the drafts each request's drafter proposed.
            budget: the step's tokens left for drafts.
            confidences: per request, the estimated acceptance of each draft given the ones
                before (with :attr:`uses_step_cost`; ``None`` otherwise).
            cost: the profiled step cost (with :attr:`uses_step_cost`; ``None`` otherwise).
            causal: sampled drafts under ``rejection`` acceptance (a draft's verify must not
                depend on later ones).
        """
        raise NotImplementedError


class FixedPolicy(VerifyPolicy):
    """``fixed``: every draft the drafter proposed, within the token budget."""

    def lengths(self, proposed, budget, confidences, cost, causal):  # noqa: D102
        return fixed_lengths(list(proposed), budget)


class DSparkPolicy(VerifyPolicy):
    """``dspark``: per request the length whose expected accepted tokens per unit of measured
    step cost is best (``varlen``), or one length for the whole step."""

    uses_step_cost = True

    def lengths(self, proposed, budget, confidences, cost, causal):  # noqa: D102
        assert confidences is not None and cost is not None
        if self.config.varlen:
            return dspark_lengths(confidences, budget, cost, causal=causal)
        return uniform_lengths(confidences, budget, cost, causal=causal)
