"""Speculative decoding: drafters propose tokens, one target forward verifies them.

* :mod:`.drafter` — the drafter interface (:class:`Drafter`, :class:`Draft`), registered through
  the ``deepinfer_register_drafters`` hook and chosen by ``SpeculativeConfig.drafter``;
* :mod:`.ngram` — the core's ``ngram`` drafter (prompt lookup, no weights);
* :mod:`.mtp` — the core's ``mtp`` drafter (the checkpoint's multi-token-prediction layer);
* :mod:`.dspark` — the core's ``dspark`` drafter (DeepSeek-V4.1's DSpark block drafter; imported
  on first use);
* :mod:`.policy` — how many drafts each request verifies per step: ``fixed`` or ``dspark``
  (confidence-scheduled against the measured step cost);
* :mod:`.verify` — acceptance: ``match`` (token-identical to plain decoding) and ``rejection``
  (rejection sampling, distribution-exact);
* :mod:`.stats` — per-request acceptance statistics and the engine's speculative metrics.

The engine side (:mod:`deepinfer_core.engine.speculative`) ties them into the step.
"""

from .drafter import ComputedChunk, Draft, DraftContext, Drafter

__all__ = ["ComputedChunk", "Draft", "DraftContext", "Drafter"]
