"""A step's sampling parameters: per request on the host (:class:`SamplingBatch`), and packed
for the device with the host's plan of which stages run (:class:`SamplingTensors`, made by
:meth:`SamplingBatch.prepare` in one non-blocking copy)."""

from __future__ import annotations

from array import array
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.penalties import bitmask_words, pad_token_rows
from deepinfer_core.sampling.random import row_keys
from deepinfer_core.sampling.transfer import Packer, tensor_to_device


class SamplingRow(Protocol):
    """What :meth:`SamplingBatch.from_requests` reads from a request."""

    params: SamplingParams
    sampling_seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_tokens(self) -> int: ...


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, in row order.

    Attributes:
        temperatures: ``[B]`` float; 0 = greedy.
        top_ps: ``[B]`` float in (0, 1].
        top_ks: ``[B]`` int; 0 or -1 = off.
        seeds: the row's sampling seed (ignored for greedy rows).
        positions: absolute position (prompt + output index) of the token each row samples.
        num_logprobs: per row, how many top logprobs to return, or ``None`` (default: none).
        min_ps: per row min-p (default: all 0).
        presence_penalties, frequency_penalties, repetition_penalties: per row (default: off).
        prompt_token_ids, output_token_ids: per row, for the penalties (needed only when a
            penalty is on).
        logit_bias: per row ``{token_id: bias}`` or ``None``.
        allowed_token_ids: per row list or ``None``.
        banned_token_ids: per row ids forced to ``-inf`` (min_tokens not reached yet).
        token_bitmask: ``[B, ceil(V/32)]`` int32 CPU tensor of packed allowed tokens (structured
            outputs: filled by the grammar matchers; all bits set on unconstrained rows), or
            ``None``.  Sent to the device in one copy and unpacked there.
    """

    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    seeds: list[int]
    positions: list[int]
    num_logprobs: list[int | None] | None = None
    min_ps: list[float] | None = None
    presence_penalties: list[float] | None = None
    frequency_penalties: list[float] | None = None
    repetition_penalties: list[float] | None = None
    prompt_token_ids: list[Sequence[int]] | None = None
    output_token_ids: list[Sequence[int]] | None = None
    logit_bias: list[dict[int, float] | None] | None = None
    allowed_token_ids: list[list[int] | None] | None = None
    banned_token_ids: list[list[int]] | None = None
    token_bitmask: torch.Tensor | None = None

    @classmethod
    def from_requests(
        cls,
        rows: Sequence[SamplingRow],
        eos_token_ids: Collection[int],
        positions: Sequence[int] | None = None,
    ) -> SamplingBatch:
        """The batch of requests about to sample.

        Args:
            rows: the sampling requests, in logits-row order.
            eos_token_ids: the model's EOS ids (banned while ``min_tokens`` is not reached).
            positions: absolute position of the token each row samples (the end of its chunk);
                default each request's ``num_tokens`` (right when its outputs are up to date).
        """
        params = [r.params for r in rows]
        distinct = {id(p): p for p in params}.values()  # requests often share one params object
        penalised = any(p.has_penalties for p in distinct)
        return cls(
            temperatures=[p.temperature for p in params],
            top_ps=[p.top_p for p in params],
            top_ks=[p.top_k for p in params],
            seeds=[r.sampling_seed for r in rows],
            positions=list(positions) if positions is not None else [r.num_tokens for r in rows],
            num_logprobs=[p.logprobs for p in params],
            min_ps=[p.min_p for p in params],
            presence_penalties=[p.presence_penalty for p in params] if penalised else None,
            frequency_penalties=[p.frequency_penalty for p in params] if penalised else None,
            repetition_penalties=[p.repetition_penalty for p in params] if penalised else None,
            prompt_token_ids=[r.prompt_token_ids for r in rows] if penalised else None,
            output_token_ids=[r.output_token_ids for r in rows] if penalised else None,
            logit_bias=[p.logit_bias for p in params] if any(p.logit_bias for p in distinct) else None,
            allowed_token_ids=[p.allowed_token_ids for p in params]
            if any(p.allowed_token_ids is not None for p in distinct)
            else None,
            banned_token_ids=[
                min_tokens_banned(r.params, len(r.output_token_ids), eos_token_ids) for r in rows
            ]
            if any(p.min_tokens for p in distinct)
            else None,
        )

    def prepare(self, device: torch.device | str, vocab_size: int) -> SamplingTensors:
        """The batch packed for the device: the host's plan (which stages run, which rows are
        greedy, sample, or want logprobs) and the per-row parameters as device tensors, moved
        by one non-blocking copy from pinned memory (none on CPU).

        The stage decisions read the parameters as the device will (rounded to fp32), so a
        stage is skipped exactly when running it would change nothing.
        """
        device = torch.device(device)
        B, V = len(self.temperatures), vocab_size
        pack = Packer()
        temps = _f32(self.temperatures)
        sample_rows = [i for i, t in enumerate(temps) if t != 0]
        n = len(sample_rows)
        seg: dict[str, int] = {}
        use_top_k_top_p = use_min_p = False
        if n:
            if n < B:
                seg["sample_index"] = pack.add(sample_rows, (n,), torch.int64)
            seg["temperatures"] = pack.add([temps[i] for i in sample_rows], (n,), torch.float32)
            top_ks = [self.top_ks[i] for i in sample_rows]
            top_ps = _f32([self.top_ps[i] for i in sample_rows])
            use_top_k_top_p = any(k > 0 or p < 1 for k, p in zip(top_ks, top_ps, strict=True))
            if use_top_k_top_p:
                seg["top_ks"] = pack.add([min(k, V) if k > 0 else 0 for k in top_ks], (n,), torch.int64)
                seg["top_ps"] = pack.add(top_ps, (n,), torch.float32)
            min_ps = _f32([self.min_ps[i] for i in sample_rows] if self.min_ps is not None else [0.0] * n)
            use_min_p = any(m > 0 for m in min_ps)
            if use_min_p:
                seg["min_ps"] = pack.add(min_ps, (n,), torch.float32)
            k1, k2 = row_keys([self.seeds[i] for i in sample_rows], [self.positions[i] for i in sample_rows])
            seg["key1"] = pack.add(k1, (n,), torch.int64)
            seg["key2"] = pack.add(k2, (n,), torch.int64)

        allowed = _rows_or(self.allowed_token_ids, B, None)
        if any(a is not None for a in allowed):
            ids = pad_token_rows(allowed, V)
            _check_ids("allowed_token_ids", ids, V)
            seg["allowed_ids"] = pack.add_rows(ids, torch.int64)
            seg["allowed_on"] = pack.add([a is not None for a in allowed], (B,), torch.bool)
        bias = _rows_or(self.logit_bias, B, None)
        if any(bias):
            ids = pad_token_rows([list(b) if b else None for b in bias], V)
            _check_ids("logit_bias", ids, V)
            values = pad_token_rows([list(b.values()) if b else None for b in bias], 0)
            seg["bias_ids"] = pack.add_rows(ids, torch.int64)
            seg["bias_values"] = pack.add_rows(values, torch.float32)
        banned = _rows_or(self.banned_token_ids, B, [])
        if any(banned):
            ids = pad_token_rows(banned, V)
            _check_ids("banned_token_ids", ids, V)
            seg["banned_ids"] = pack.add_rows(ids, torch.int64)

        use_penalties = self.repetition_penalties is not None or self.presence_penalties is not None
        use_repetition = False
        if use_penalties:
            if self.prompt_token_ids is None or self.output_token_ids is None:
                raise ValueError("penalties need the rows' prompt_token_ids and output_token_ids")
            reps = _f32(_rows_or(self.repetition_penalties, B, 1.0))
            use_repetition = any(r != 1 for r in reps)
            seg["presence"] = pack.add(_rows_or(self.presence_penalties, B, 0.0), (B,), torch.float32)
            seg["frequency"] = pack.add(_rows_or(self.frequency_penalties, B, 0.0), (B,), torch.float32)
            seg["output_ids"] = pack.add_rows(pad_token_rows(self.output_token_ids, V), torch.int64)
            if use_repetition:
                seg["repetition"] = pack.add(reps, (B,), torch.float32)
                seg["prompt_ids"] = pack.add_rows(pad_token_rows(self.prompt_token_ids, V), torch.int64)

        num_logprobs = _rows_or(self.num_logprobs, B, None)
        logprob_rows = [i for i, k in enumerate(num_logprobs) if k is not None]
        if 0 < len(logprob_rows) < B:
            seg["logprob_index"] = pack.add(logprob_rows, (len(logprob_rows),), torch.int64)

        tensors = pack.to(device)
        t = {name: tensors[i] for name, i in seg.items()}
        if self.token_bitmask is not None:
            want = (B, bitmask_words(V))
            if tuple(self.token_bitmask.shape) != want:
                raise ValueError(
                    f"token_bitmask has shape {tuple(self.token_bitmask.shape)}, expected {want}"
                )
            t["bitmask"] = tensor_to_device(self.token_bitmask, device)
        return SamplingTensors(
            num_rows=B,
            vocab_size=V,
            sample_rows=sample_rows,
            logprob_rows=logprob_rows,
            num_logprobs=[int(num_logprobs[i] or 0) for i in logprob_rows],
            use_top_k_top_p=use_top_k_top_p,
            use_min_p=use_min_p,
            use_penalties=use_penalties,
            use_repetition=use_repetition,
            **t,
        )


@dataclass
class SamplingTensors:
    """A :class:`SamplingBatch` ready for :meth:`Sampler.sample`: the host's plan (plain Python,
    fixed before launch) and the parameters as device tensors (``None`` where a stage is off).

    Row subsets are given as index tensors so the device never has to find them:
    ``sample_index`` (``[n]``, the non-greedy rows; ``None`` when every row samples or none
    does) and ``logprob_index`` (``[m]``; ``None`` when every row or no row wants logprobs).
    Per sampled row (``[n]``): ``temperatures`` fp32, ``top_ks`` int64 (``<= 0`` off, clamped to
    ``V``), ``top_ps``, ``min_ps`` fp32, ``key1`` / ``key2`` the counter-based draw's row keys.
    Per row (``[B]`` / ``[B, W]``, id lists padded with ``V``): ``allowed_ids`` + ``allowed_on``,
    ``bitmask`` (``[B, ceil(V/32)]`` int32, packed allowed tokens),
    ``bias_ids`` + ``bias_values``, ``banned_ids``, ``presence`` / ``frequency`` /
    ``repetition`` penalties and the ``output_ids`` / ``prompt_ids`` they count.
    """

    num_rows: int
    vocab_size: int
    sample_rows: list[int]
    logprob_rows: list[int]
    num_logprobs: list[int]
    use_top_k_top_p: bool = False
    use_min_p: bool = False
    use_penalties: bool = False
    use_repetition: bool = False
    sample_index: torch.Tensor | None = None
    temperatures: torch.Tensor | None = None
    top_ks: torch.Tensor | None = None
    top_ps: torch.Tensor | None = None
    min_ps: torch.Tensor | None = None
    key1: torch.Tensor | None = None
    key2: torch.Tensor | None = None
    allowed_ids: torch.Tensor | None = None
    allowed_on: torch.Tensor | None = None
    bitmask: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    banned_ids: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    output_ids: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None
    logprob_index: torch.Tensor | None = None

    @property
    def masks_logits(self) -> bool:
        """An allowed-token list, grammar bitmask, bias or ban applies to some row."""
        return any(t is not None for t in (self.allowed_ids, self.bitmask, self.bias_ids, self.banned_ids))

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy and no stage changes the logits (no mask, bias, ban or penalty):
        :meth:`Sampler.sample` is then the argmax of the raw logits."""
        return not self.sample_rows and not self.use_penalties and not self.masks_logits


def min_tokens_banned(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: Collection[int]
) -> list[int]:
    """Token ids a request may not sample yet: EOS (unless ``ignore_eos``) and ``stop_token_ids``
    while fewer than ``min_tokens`` tokens were generated."""
    if num_output_tokens >= params.min_tokens:
        return []
    eos = [] if params.ignore_eos else list(eos_token_ids)
    return list(dict.fromkeys([*eos, *params.stop_token_ids]))


def _rows_or(values: list | None, n: int, default: object) -> list:
    return list(values) if values is not None else [default] * n


def _f32(values: Iterable[float]) -> list[float]:
    """The values as the device holds them in fp32 (for host decisions that must agree)."""
    return array("f", values).tolist()


def _check_ids(name: str, rows: list[list[int]], vocab_size: int) -> None:
    bad = [t for r in rows for t in r if not 0 <= t <= vocab_size]  # V: the padding id
    if bad:
        raise ValueError(f"{name}: token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
