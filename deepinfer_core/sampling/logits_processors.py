"""Custom logits processors: per-request state, a batched apply on the device, token callbacks.

A plugin registers a processor class through the ``deepinfer_register_logits_processors`` hook
(``register(name, factory)``, ``factory()`` returning the class); a request selects it by name
with ``SamplingParams(logits_processors={"name": {...args}})`` (or a list of names, each with
no arguments).  The engine builds one instance per processor per engine, on first use, with the
model's vocabulary size and the device, and for each request that selects it:

1. :meth:`LogitsProcessor.add_request` (its arguments and prompt ids) at submission (an
   exception fails that request alone, with ``finish_reason="error"`` and the message; the
   others proceed);
2. before every step that samples for the request, :meth:`LogitsProcessor.on_tokens` with the
   tokens appended to its output since the last call (accepted tokens only), then one
   :meth:`LogitsProcessor.apply` per step for the whole batch: ``logits [B, V]`` fp32 on the
   device and ``request_ids`` (``None`` for rows that did not select the processor, which
   must come back unchanged);
3. :meth:`LogitsProcessor.remove_request` when the request finishes (any reason).

Speculative decoding verifies several positions of a request in one step: the engine then
calls ``apply`` once per verified position ``i`` (rows of the other positions ``None``),
after passing the draft tokens before ``i`` to ``on_tokens``, and finally
:meth:`LogitsProcessor.on_rollback` with the number of draft tokens it passed; the accepted
ones come again through ``on_tokens`` before the next step.  A processor that cannot roll
back (``supports_rollback = False``, the default) makes its requests decode without drafts.

The processed logits then go through the sampler's own stages (allowed ids, bias, penalties,
temperature...); processors run in the order the request lists them, each on the whole batch.
Logprobs are computed from the logits after the processors (as HF's ``logits_processor``).
``apply`` runs on the step's tensors: keep it on the device without host syncs, so async
scheduling keeps overlapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class LogitsProcessor:
    """Base class of a custom logits processor (see the module docstring).

    Args:
        vocab_size: the model's vocabulary size (the logits' width).
        device: the device the logits live on.
    """

    supports_rollback: bool = False
    """Whether :meth:`on_rollback` is implemented (speculative decoding needs it)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    def add_request(self, request_id: str, args: dict[str, Any], prompt_token_ids: Sequence[int]) -> None:
        """Start tracking ``request_id`` with its arguments and prompt; raise (``ValueError``)
        to reject it."""

    def on_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Tokens appended to the request's output since the last call, in order."""

    def on_rollback(self, request_id: str, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` tokens given to :meth:`on_tokens` (draft tokens of a
        verify step); only called when :attr:`supports_rollback` is true."""
        raise NotImplementedError

    def remove_request(self, request_id: str) -> None:
        """The request finished (stop, length, abort or error): drop its state."""

    def apply(self, logits: torch.Tensor, request_ids: Sequence[str | None]) -> torch.Tensor:
        """The processed ``logits`` (``[B, V]`` fp32, may be changed in place and returned); rows
        whose id is ``None`` must be left as they are."""
        raise NotImplementedError


def normalize_processor_args(value: Any) -> dict[str, dict[str, Any]] | None:
    """``SamplingParams.logits_processors`` as ``{name: args}`` (a list of names: empty args);
    raises :class:`ValueError` naming what is wrong."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not all(isinstance(n, str) and n for n in value):
            raise ValueError("a list of logits processor names must hold non-empty strs")
        return {n: {} for n in value}
    if isinstance(value, dict):
        out: dict[str, dict[str, Any]] = {}
        for name, args in value.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"logits processor name {name!r} is not a non-empty str")
            if args is None:
                args = {}
            if not isinstance(args, dict):
                raise ValueError(f"arguments of logits processor {name!r} must be a dict, got {args!r}")
            out[name] = dict(args)
        return out
    raise ValueError(f"expected None, a list of names or a dict name -> args, got {type(value).__name__}")
