"""The engine's logits processors: the plugin processors requests select by name, built once per
engine, fed each request's new tokens and run on the step's logits.

The interface a processor implements and the order of its calls are in
:mod:`deepinfer_core.sampling.logits_processors`; plugins register processors through the
``deepinfer_register_logits_processors`` hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.plugins.lookup import ComponentLookup
from deepinfer_core.sampling.logits_processors import LogitsProcessor

if TYPE_CHECKING:
    from deepinfer_core.engine.request import Request


class LogitsProcessors:
    """The logits processors of one engine, by name.

    Args:
        plugins: the plugin manager (its ``logits_processors`` components).
        vocab_size, device: what each processor is built with, on first use.
    """

    def __init__(self, plugins: Any, vocab_size: int, device: torch.device) -> None:
        self._lookup = ComponentLookup(
            plugins,
            "logits_processors",
            "logits processor {}",
            error=RuntimeError,
            build=lambda cls: cls(vocab_size, device),
        )

    def get(self, name: str) -> LogitsProcessor:
        """The engine's instance of processor ``name`` (built on first use); raises
        :class:`RuntimeError` naming the registered ones when it is unknown, unavailable or
        fails to start (kept: the plugin is not asked again)."""
        return self._lookup.get(name)

    def attach(self, req: Request) -> str | None:
        """Register ``req`` with the processors it selects; the error message if one is unknown
        or rejects its arguments (the processors it already joined release it)."""
        assert req.params.logits_processors is not None
        for name, args in req.params.logits_processors.items():
            try:
                self.get(name).add_request(req.request_id, args, req.prompt_token_ids)
            except Exception as e:
                self.release(req)
                return f"request {req.request_id!r}: logits processor {name!r}: {e}"
            req.logits_processors.append(name)
        return None

    def release(self, req: Request) -> None:
        """Tell the processors ``req`` joined that it is finished (once)."""
        names, req.logits_processors = req.logits_processors, []
        for name in names:
            self.get(name).remove_request(req.request_id)

    def can_roll_back(self, req: Request) -> bool:
        """Whether every processor ``req`` joined can take draft tokens back."""
        return all(self.get(n).supports_rollback for n in req.logits_processors)

    def feed(self, requests: list[Request]) -> list[str]:
        """Give each processor its requests' output tokens appended since the last call
        (``on_tokens``); returns the processors these requests selected, in their order of
        selection."""
        order: list[str] = []
        for req in requests:
            if req.logits_processors:
                new = req.output_token_ids[req.processed_tokens :]
                req.processed_tokens = len(req.output_token_ids)
                for name in req.logits_processors:
                    if new:
                        self.get(name).on_tokens(req.request_id, new)
                    if name not in order:
                        order.append(name)
        return order

    def apply(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Feed each processor its requests' new tokens, then run it once on the batch (rows of
        other requests as ``None``), in each request's order of selection."""
        order = self.feed(requests)
        with torch.inference_mode():  # the logits are inference tensors: in-place edits allowed
            for name in order:
                rows = [r.request_id if name in r.logits_processors else None for r in requests]
                logits = self.get(name).apply(logits, rows)
        return logits
