"""Structured outputs in the engine: grammar backends, per-request matchers and the token
bitmask of each step.

A request with ``SamplingParams.structured_outputs`` gets a matcher from its grammar backend
(a plugin: ``deepinfer_register_structured_backends``) when it is added.  Each step the
matchers first consume the tokens their requests gained since the last step, then every
backend fills its rows of one packed ``[B, ceil(V/32)]`` int32 bitmask in one batched call;
the sampler copies it to the device once and unpacks it there.

The masks are computed while the forward whose logits they restrict runs:

* on an accelerator the forward is launched asynchronously, so the host fills the masks
  after launching it (:meth:`StructuredOutputs.fill` from the sampling code);
* on the CPU the forward runs on the calling thread, so the engine processes the previous
  step's outputs first (:meth:`StructuredOutputs.wants_tokens_first`: nothing is lost, the
  device being the host), :meth:`StructuredOutputs.start` hands the fill to a worker thread
  before the forward and :meth:`StructuredOutputs.apply` joins it afterwards (PyTorch's CPU
  kernels and the grammar libraries' native code release the GIL, so the two overlap on a
  machine with a spare core).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.errors import PluginError
from deepinfer_core.plugins.lookup import ComponentLookup, Unusable
from deepinfer_core.sampling.penalties import bitmask_has, bitmask_of, bitmask_words

if TYPE_CHECKING:
    from deepinfer_core.engine.request import Request
    from deepinfer_core.sampling.batch import SamplingBatch


@dataclass
class MaskFill:
    """A step's bitmask with the rows a grammar constrained."""

    bitmask: torch.Tensor
    rows: list[int]


class StructuredOutputs:
    """The engine's grammar backends (built once each) and its per-step token masks.

    Args:
        plugins: the plugin manager (its ``structured_backends`` components).
        tokenizer: the engine's tokenizer, or ``None`` (then structured outputs fail per
            request, saying why: ``tokenizer_error``).
        vocab_size: the model's vocabulary (the bitmask's width).
        eos_token_ids: the ids that end a request (allowed where a grammar accepts).
        overlap: fill the masks on a worker thread while the forward runs (for a device
            whose forward runs on the host thread: the CPU).
    """

    def __init__(
        self,
        plugins: Any,
        tokenizer: Any,
        tokenizer_error: str | None,
        vocab_size: int,
        eos_token_ids: list[int],
        overlap: bool,
    ) -> None:
        self.plugins = plugins
        self.tokenizer = tokenizer
        self.tokenizer_error = tokenizer_error
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.overlap = overlap
        self._backends = backend_lookup(plugins, build=self._build)  # built once each, or why not
        self._pool: ThreadPoolExecutor | None = None

    # ---- backends and matchers -------------------------------------------------------------------
    def backend(self, name: str) -> Any:
        """The grammar backend ``name`` (built once per engine); raises :class:`RuntimeError`
        naming what to install when it is unknown or unavailable."""
        return self._backends.get(name)

    def _build(self, cls: Any) -> Any:
        if self.tokenizer is None:
            raise Unusable(
                f"structured outputs need a tokenizer, and the engine has none ({self.tokenizer_error})"
            )
        return cls(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def attach(self, req: Request) -> str | None:
        """Give ``req`` its grammar matcher (``req.structured_matcher``); the error message (one
        line) if the backend is missing or the spec invalid."""
        spec = req.params.structured_outputs
        assert spec is not None
        try:
            backend = self.backend(spec.backend)
        except (RuntimeError, PluginError) as e:
            return f"request {req.request_id!r}: structured outputs: {e}"
        try:
            req.structured_matcher = backend.matcher(spec)
        except Exception as e:
            return f"request {req.request_id!r}: structured outputs: {spec_kind(spec)}: {one_line(e)}"
        return None

    # ---- the step's masks ------------------------------------------------------------------------
    def fill(self, requests: Sequence[Request]) -> MaskFill:
        """Advance each constrained request's matcher over its new tokens and fill the rows of
        a fresh all-allowed bitmask (row ``i`` = ``requests[i]``), one batched call per
        grammar backend."""
        return self._fill_rows(self._advance(requests), len(requests))

    def _advance(self, requests: Sequence[Request]) -> dict[str, list[tuple[Any, int]]]:
        """Let each constrained request's matcher consume its new tokens; the ``(matcher,
        row)`` pairs by grammar backend."""
        by_backend: dict[str, list[tuple[Any, int]]] = {}
        for i, req in enumerate(requests):
            matcher = req.structured_matcher
            if matcher is not None:
                matcher.consume(req.output_token_ids[matcher.num_consumed :])
                by_backend.setdefault(req.params.structured_outputs.backend, []).append((matcher, i))
        return by_backend

    def _fill_rows(self, by_backend: dict[str, list[tuple[Any, int]]], num_rows: int) -> MaskFill:
        bitmask = torch.full((num_rows, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        for name, pairs in by_backend.items():
            self.backend(name).fill_bitmasks(pairs, bitmask)
        return MaskFill(bitmask, [i for pairs in by_backend.values() for _, i in pairs])

    def wants_tokens_first(self, running: Sequence[Request]) -> bool:
        """With :attr:`overlap`, whether the engine should process the step in flight before
        scheduling the next: a running request is constrained, and its mask can only be
        filled alongside the forward once its last token is in.  (On the CPU the forward
        runs on the calling thread, so processing a step early costs nothing; it also
        schedules the next step with the finished requests' slots free.)"""
        return self.overlap and any(r.structured_matcher is not None for r in running)

    def start(self, requests: Sequence[Request]) -> Future[MaskFill] | None:
        """With :attr:`overlap`, begin :meth:`fill` for ``requests`` on the worker thread (the
        caller runs the forward meanwhile and must not touch their matchers until
        :meth:`apply`); ``None`` otherwise, when no request is constrained, or when one still
        waits for a token (its mask is then filled in :meth:`apply`)."""
        constrained = [r for r in requests if r.structured_matcher is not None]
        # scheduled: one pending token (this step's); two: the previous step's is not in yet
        if not self.overlap or not constrained or any(r.num_pending > 1 for r in constrained):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-grammar")
        by_backend = self._advance(requests)  # on this thread: Python, holding the GIL
        return self._pool.submit(self._fill_rows, by_backend, len(requests))

    def apply(
        self, batch: SamplingBatch, requests: Sequence[Request], started: Future[MaskFill] | None = None
    ) -> None:
        """Set ``batch.token_bitmask`` for ``requests`` (the step's sampling rows): the fill
        ``started`` on the worker, else one computed now; nothing when no row is constrained."""
        if started is not None:
            done = started.result()
        elif any(r.structured_matcher is not None for r in requests):
            done = self.fill(requests)
        else:
            return
        self.finish(batch, done.bitmask, done.rows)

    def finish(self, batch: SamplingBatch, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Hand ``bitmask`` to ``batch`` once its grammar-constrained ``rows`` are filled: a row
        the grammar allows nothing in (an error state) may end with EOS; a row's own
        ``allowed_token_ids`` intersect the grammar's or, sharing no token with it, yield."""
        allowed_lists = batch.allowed_token_ids
        for i in (torch.tensor(rows, dtype=torch.int64)[~bitmask[rows].any(dim=1)]).tolist():
            bitmask[i] = bitmask_of(self.eos_token_ids, self.vocab_size)  # nothing allowed: end
        for i in rows:
            extra = allowed_lists[i] if allowed_lists is not None else None
            if extra is not None and not any(bitmask_has(bitmask[i], t) for t in extra):
                allowed_lists[i] = None  # no common token: the grammar's own choice
        batch.token_bitmask = bitmask

    def close(self) -> None:
        """Stop the worker thread (if one was started)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def backend_lookup(plugins: Any, build: Any = None) -> ComponentLookup:
    """The lookup of grammar backends: :class:`RuntimeError` naming what to install when one is
    unknown or unavailable (the plugin's probe says what); ``build`` makes the kept instance
    from the class (default: the class itself)."""
    return ComponentLookup(
        plugins,
        "structured_backends",
        "structured outputs backend {}",
        error=RuntimeError,
        hint="; 'llguidance' and 'xgrammar' come with the samplers plugin, from the root of a "
        "DeepInfer checkout: pip install -e 'plugins/samplers[structured]'",
        build=build,
    )


def check_spec(plugins: Any, spec: Any) -> None:
    """Compile ``spec`` (a :class:`~deepinfer_core.StructuredOutputsParams`) with its backend
    before any engine exists, without a tokenizer (the CLI's check of its flags).

    Raises :class:`ValueError` with a one-line reason when the backend is missing or
    unavailable, or when its ``check_spec(spec)`` (optional; see
    ``deepinfer_register_structured_backends``) finds the spec invalid.  A backend without
    ``check_spec`` checks each spec when its request is added, as always.
    """
    try:
        cls = backend_lookup(plugins).get(spec.backend)
    except (RuntimeError, PluginError) as e:
        raise ValueError(str(e)) from None
    check = getattr(cls, "check_spec", None)
    if check is None:
        return
    try:
        check(spec)
    except Exception as e:  # a backend's ValueError, or whatever its compiler raised
        raise ValueError(one_line(e)) from None


def spec_kind(spec: Any) -> str:
    """Which of its four kinds ``spec`` is: ``"choice"``, ``"regex"``, ``"grammar"`` or
    ``"JSON schema"`` (the name error messages use)."""
    if spec.choice is not None:
        return "choice"
    if spec.regex is not None:
        return "regex"
    if spec.grammar is not None:
        return "grammar"
    return "JSON schema"


def one_line(error: BaseException | str) -> str:
    """A backend's error as one line: its non-blank lines, stripped and joined with ``"; "``
    (the backends already give one line; this keeps a multi-line message from a third-party
    backend from breaking the one-line rule)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__
