"""``EngineClient``: what :class:`~deepinfer_core.LLM` drives, in one process or many.

Both the single-process :class:`~deepinfer_core.engine.llm_engine.LLMEngine` and rank 0's
:class:`~deepinfer_core.distributed.coordinator.Coordinator` (which drives an engine on every
rank of a distributed run) implement it; ``LLM`` calls nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from deepinfer_core.engine.resolved import ResolvedConfig
    from deepinfer_core.outputs import RequestOutput
    from deepinfer_core.sampling.params import SamplingParams


class GeneratedTokens(Protocol):
    """The running total a progress bar reads."""

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated since start."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """The engine interface of :class:`~deepinfer_core.LLM`."""

    @property
    def config(self) -> ResolvedConfig:
        """The resolved configuration (of rank 0's engine in a distributed run)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The tokenizer, or ``None`` when the model directory has none."""
        ...

    @property
    def metrics(self) -> GeneratedTokens:
        """Live totals; at least ``num_generated_tokens`` (summed over the replicas)."""
        ...

    @property
    def kv_cache_capacity_tokens(self) -> int:
        """Token positions the paged KV cache holds (the replicas' caches together)."""
        ...

    def check_params(self, params: SamplingParams) -> None:
        """Raise :class:`~deepinfer_core.errors.SamplingParamsError` when ``params`` cannot be
        served (token ids outside the vocabulary, stop strings without a tokenizer)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Tokenize a prompt."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        sample_index: int = 0,
    ) -> object:
        """Queue one request (one sample of a prompt: ``sample_index`` of ``params.n``).

        Returns a handle of the request: the single-process engine returns its
        :class:`~deepinfer_core.engine.request.Request`, whose ``output_token_ids`` and
        ``output_text`` grow step by step (read between steps, on the thread that steps: the
        server's incremental text, :mod:`deepinfer_core.serve.engine_loop`); the distributed
        coordinator returns ``None`` (its requests live on the ranks)."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests that finished."""
        ...

    def has_unfinished(self) -> bool:
        """Whether any request is still queued, running or not yet returned."""
        ...

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests at the next step (thread-safe)."""
        ...

    def abort_all(self, reason: str) -> list[RequestOutput]:
        """Finish every unfinished request with ``finish_reason="error"``."""
        ...

    def get_metrics(self) -> dict[str, Any]:
        """The totals since start, a plain dict (:meth:`~deepinfer_core.LLM.get_metrics`)."""
        ...

    def reset_metrics(self) -> None:
        """Zero the totals :meth:`get_metrics` reports."""
        ...

    def shutdown(self) -> None:
        """Release what the client holds (worker threads, processes); idempotent."""
        ...
