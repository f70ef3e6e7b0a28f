"""Batched sampling: logits of the rows that sample -> next tokens (+ optional logprobs).

Order per row, as in vLLM:

1. ``allowed_token_ids`` and the structured-output token bitmask (every other token ->
   ``-inf``), ``logit_bias`` (added), and while fewer than ``min_tokens`` tokens were
   generated, EOS and ``stop_token_ids`` -> ``-inf``;
2. penalties: repetition (prompt + output tokens), then frequency and presence (output tokens);
3. greedy rows (``temperature == 0``) take the argmax of these processed logits
   (``torch.argmax`` returns the first maximum, so ties go to the lowest token id);
4. other rows: logits / temperature, then top-k, top-p over the renormalised top-k
   distribution (the mass *before* each token must be below ``top_p``; one token always
   survives), then min-p (probability >= ``min_p`` x the largest);
5. the draw: ``argmax(scaled + gumbel)`` over the surviving tokens, where the Gumbel noise is a
   pure function of (request seed, position of the token being sampled, token id)
   (:mod:`deepinfer_core.sampling.random`).  That is an exact sample of the renormalised
   filtered distribution, and a seeded row's token depends on nothing else: not on the other
   rows, its row index, prefill chunking, async scheduling or a preemption that recomputes it.

Logprobs are ``log_softmax`` of the raw fp32 logits (the model's distribution, before any of
the steps above), as vLLM returns them by default.

No host sync on the step's tensors.  :meth:`SamplingBatch.prepare` packs the per-row
parameters on the host (plain Python: which stages run, which rows are greedy or want logprobs
are host decisions) into one float64 buffer, moved to the device by a single non-blocking copy
from pinned memory; :meth:`Sampler.sample` is then pure device work on fixed shapes (no
``.item()``, ``nonzero``, boolean indexing or branch on a tensor value), so it can run inside a
captured step.  Logprobs (top-k values and ids, the sampled token's) stay on the device: the
host reads them only when :attr:`SamplerOutput.logprobs` is first read, when the engine
processes the step's outputs.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, overload

import torch

from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.penalties import (
    apply_allowed_bias_bans_padded,
    apply_penalties_padded,
    bitmask_words,
    pad_token_rows,
)
from deepinfer_core.sampling.random import derive_seed, gumbel_noise_from_keys, row_keys

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingTensors",
    "derive_seed",
    "host_to_device",
    "top_k_top_p_keep",
]


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
        penalised = any(p.has_penalties for p in params)
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
            logit_bias=[p.logit_bias for p in params],
            allowed_token_ids=[p.allowed_token_ids for p in params],
            banned_token_ids=[
                min_tokens_banned(r.params, len(r.output_token_ids), eos_token_ids) for r in rows
            ],
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
        pack = _Packer()
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


class Logprobs(Sequence["dict[int, float] | None"]):
    """Per row ``{token_id: logprob}`` or ``None``, read from the device on first access.

    Holds the device results of :func:`device_top_logprobs` (one ``[m, 2K + 2]`` float64
    tensor: top-``K`` values, their ids, the chosen token and its logprob) and turns them into dicts
    the first time an entry is read; on CUDA the copy to pinned host memory is started when it
    is made, so that read only waits for it.
    """

    def __init__(
        self, num_rows: int, rows: Sequence[int], ks: Sequence[int], packed: torch.Tensor | None
    ) -> None:
        self._num_rows, self._rows, self._ks = num_rows, list(rows), list(ks)
        self._packed, self._event = packed, None
        self._entries: list[dict[int, float] | None] | None = None
        if packed is not None and packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._packed = host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def _materialize(self) -> list[dict[int, float] | None]:
        if self._entries is None:
            entries: list[dict[int, float] | None] = [None] * self._num_rows
            if self._packed is not None:
                if self._event is not None:
                    self._event.synchronize()
                values = self._packed.tolist()
                width = (len(values[0]) - 2) // 2 if values else 0  # top-k columns
                for row, k, v in zip(self._rows, self._ks, values, strict=True):
                    k = min(k, width)
                    entry = dict(zip(map(int, v[width : width + k]), v[:k], strict=True))
                    entry[int(v[-2])] = v[-1]  # the chosen token (it may be one of the top k)
                    entries[row] = entry
            self._entries = entries
        return self._entries

    @overload
    def __getitem__(self, i: int) -> dict[int, float] | None: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[int, float] | None]: ...
    def __getitem__(self, i: int | slice) -> dict[int, float] | None | list[dict[int, float] | None]:
        return self._materialize()[i]

    def __len__(self) -> int:
        return self._num_rows

    def __iter__(self) -> Iterator[dict[int, float] | None]:
        return iter(self._materialize())  # not one __getitem__ per row (the Sequence default)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Logprobs):
            return self._materialize() == other._materialize()
        if isinstance(other, list):
            return self._materialize() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Logprobs({self._materialize()!r})"


@dataclass
class SamplerOutput:
    """Sampled tokens ``[B]`` (int64, on the logits' device) and per row ``{token_id: logprob}``
    or ``None`` (a :class:`Logprobs`: read from the device when first accessed)."""

    token_ids: torch.Tensor
    logprobs: Sequence[dict[int, float] | None]


def top_k_top_p_keep(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Which tokens survive top-k then top-p, as a bool mask ``[B, V]`` in vocabulary order.

    Args:
        logits: ``[B, V]`` fp32 (already temperature-scaled).
        top_ks: ``[B]`` int64; ``<= 0`` = off.
        top_ps: ``[B]`` float; ``1`` = off.
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    keep_sorted = _keep_sorted(sorted_logits, top_ks, top_ps)
    keep = torch.empty_like(keep_sorted)
    keep.scatter_(1, order, keep_sorted)
    return keep


def min_p_keep(scaled: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Tokens whose probability under ``softmax(scaled)`` is at least ``min_p`` x the largest."""
    probs = torch.softmax(scaled, dim=-1)
    return probs >= min_ps[:, None] * probs.amax(dim=-1, keepdim=True)


def _keep_sorted(sorted_logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    V = sorted_logits.shape[-1]
    ranks = torch.arange(V, device=sorted_logits.device)
    k = torch.where(top_ks > 0, top_ks.clamp(max=V), torch.full_like(top_ks, V))
    keep = ranks[None, :] < k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass strictly before each token
    keep &= before < top_ps[:, None]
    keep[:, 0] = True
    return keep


def _rows_or(values: list | None, n: int, default: object) -> list:
    return list(values) if values is not None else [default] * n


def _f32(values: Iterable[float]) -> list[float]:
    """The values as the device holds them in fp32 (for host decisions that must agree)."""
    return array("f", values).tolist()


def _check_ids(name: str, rows: list[list[int]], vocab_size: int) -> None:
    bad = [t for r in rows for t in r if not 0 <= t <= vocab_size]  # V: the padding id
    if bad:
        raise ValueError(f"{name}: token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")


class _Packer:
    """Host values of several tensors in one float64 buffer (exact for fp32 values and for
    integers below 2**53), sent to the device in one copy; there each dtype's values are
    converted at once and cut into views."""

    def __init__(self) -> None:
        self._groups: dict[torch.dtype, tuple[array, list[tuple[int, int, tuple[int, ...]]]]] = {}
        self._where: list[tuple[torch.dtype, int]] = []

    def add(self, values: Iterable[float], shape: tuple[int, ...], dtype: torch.dtype) -> int:
        data, segments = self._groups.setdefault(dtype, (array("d"), []))
        start = len(data)
        data.extend(values)
        segments.append((start, len(data), shape))
        self._where.append((dtype, len(segments) - 1))
        return len(self._where) - 1

    def add_rows(self, rows: list[list[int]] | list[list[float]], dtype: torch.dtype) -> int:
        shape = (len(rows), len(rows[0]) if rows else 0)
        return self.add(itertools.chain.from_iterable(rows), shape, dtype)

    def to(self, device: torch.device) -> list[torch.Tensor]:
        if not self._where:
            return []
        data = array("d")
        for group, _ in self._groups.values():
            data.extend(group)
        flat = host_to_device(data, device)
        views: dict[torch.dtype, list[torch.Tensor]] = {}
        offset = 0
        for dtype, (group, segments) in self._groups.items():
            typed = flat[offset : offset + len(group)].to(dtype)
            offset += len(group)
            views[dtype] = [typed[a:b].view(shape) for a, b, shape in segments]
        return [views[dtype][i] for dtype, i in self._where]


def host_to_device(values: array | Sequence[float], device: torch.device | str) -> torch.Tensor:
    """Host values as a float64 tensor on ``device``: on CUDA by a non-blocking copy from pinned
    memory (no host sync; the caching host allocator keeps the buffer until the copy is done),
    on CPU without a copy."""
    data = values if isinstance(values, array) and values.typecode == "d" else array("d", values)
    host = torch.frombuffer(data, dtype=torch.float64) if len(data) else torch.empty(0, dtype=torch.float64)
    return tensor_to_device(host, device)


def tensor_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor on ``device``, as :func:`host_to_device` (pinned, non-blocking on CUDA)."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        return pinned.copy_(host).to(device, non_blocking=True)
    return host.to(device, non_blocking=True)


class Sampler:
    """Samples one token per row of fp32 logits ``[B, V]``; see the module docstring."""

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch | SamplingTensors) -> torch.Tensor:
        """Steps 1-2 of the module docstring: masks, bias and penalties, before temperature."""
        raw = logits.float()
        return self._process(raw, _prepared(batch, raw))

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch | SamplingTensors) -> SamplerOutput:
        raw = logits.float()
        prep = _prepared(batch, raw)
        token_ids, logprobs = self.sample(raw, prep)
        # token ids stay on the device: async scheduling feeds them to the next step without a
        # host round trip; logprobs are read back only when the engine processes the outputs
        return SamplerOutput(
            token_ids, Logprobs(prep.num_rows, prep.logprob_rows, prep.num_logprobs, logprobs)
        )

    def sample(self, raw: torch.Tensor, prep: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The device part of a step (no host sync, shapes fixed by ``prep``): the sampled
        tokens ``[B]`` int64 and the packed logprobs of :func:`device_top_logprobs` (or
        ``None`` when no row wants logprobs)."""
        processed = self._process(raw, prep)
        if not prep.sample_rows:  # all greedy: no draw, no per-row routing
            out = torch.argmax(processed, dim=-1)
        elif prep.sample_index is None:  # every row samples
            assert prep.temperatures is not None
            out = self._draw(processed.contiguous() / prep.temperatures[:, None], prep)
        else:  # greedy rows take the argmax, the others (gathered by a host-made index) draw
            assert prep.temperatures is not None
            rows = processed.index_select(0, prep.sample_index)
            drawn = self._draw(rows / prep.temperatures[:, None], prep)
            out = torch.argmax(processed, dim=-1).index_copy_(0, prep.sample_index, drawn)
        logprobs = None
        if prep.logprob_rows:
            tokens = out if prep.logprob_index is None else out.index_select(0, prep.logprob_index)
            rows = raw if prep.logprob_index is None else raw.index_select(0, prep.logprob_index)
            logprobs = device_top_logprobs(rows, tokens, max(prep.num_logprobs))
        return out, logprobs

    def distribution(self, raw: torch.Tensor, prep: SamplingTensors) -> torch.Tensor:
        """The distribution each row's draw samples from, ``[B, V]`` float64: for sampling rows
        ``softmax`` of the processed, temperature-scaled logits over the tokens that survive
        top-k / top-p / min-p; for greedy rows one-hot on the argmax.  (Speculative decoding's
        rejection test compares it with the drafter's.)"""
        processed = self._process(raw, prep)
        probs = torch.zeros(processed.shape, dtype=torch.float64, device=processed.device)
        probs.scatter_(1, torch.argmax(processed, dim=-1, keepdim=True), 1.0)
        if prep.sample_rows:
            assert prep.temperatures is not None
            index = prep.sample_index
            rows = processed if index is None else processed.index_select(0, index)
            scaled = rows / prep.temperatures[:, None]
            keep = self._keep(scaled, prep)
            if keep is not None:
                scaled = scaled.masked_fill(~keep, float("-inf"))
            sampled = torch.softmax(scaled.double(), dim=-1)
            probs = sampled if index is None else probs.index_copy_(0, index, sampled)
        return probs

    @staticmethod
    def _keep(scaled: torch.Tensor, prep: SamplingTensors) -> torch.Tensor | None:
        """The tokens of the sampled rows that survive top-k / top-p and min-p (``None``: all)."""
        keep = None
        if prep.use_top_k_top_p:
            assert prep.top_ks is not None and prep.top_ps is not None
            keep = top_k_top_p_keep(scaled, prep.top_ks, prep.top_ps)
        if prep.use_min_p:
            assert prep.min_ps is not None
            by_min_p = min_p_keep(scaled, prep.min_ps)
            keep = by_min_p if keep is None else keep & by_min_p
        return keep

    @staticmethod
    def _process(out: torch.Tensor, prep: SamplingTensors) -> torch.Tensor:
        allowed = (prep.allowed_ids, prep.allowed_on) if prep.allowed_ids is not None else None
        bias = (prep.bias_ids, prep.bias_values) if prep.bias_ids is not None else None
        if prep.masks_logits:
            out = apply_allowed_bias_bans_padded(out, allowed, bias, prep.banned_ids, prep.bitmask)  # type: ignore[arg-type]
        if prep.use_penalties:
            assert prep.output_ids is not None and prep.presence is not None and prep.frequency is not None
            out = apply_penalties_padded(
                out, prep.output_ids, prep.prompt_ids, prep.presence, prep.frequency, prep.repetition
            )
        return out

    @classmethod
    def _draw(cls, scaled: torch.Tensor, prep: SamplingTensors) -> torch.Tensor:
        assert prep.key1 is not None and prep.key2 is not None
        keep = cls._keep(scaled, prep)
        noisy = scaled.double() + gumbel_noise_from_keys(prep.key1, prep.key2, scaled.shape[1])
        if keep is not None:
            noisy = noisy.masked_fill(~keep, float("-inf"))
        return torch.argmax(noisy, dim=-1)


def _prepared(batch: SamplingBatch | SamplingTensors, logits: torch.Tensor) -> SamplingTensors:
    if isinstance(batch, SamplingTensors):
        return batch
    return batch.prepare(logits.device, logits.shape[1])


def device_top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """``log_softmax`` of ``logits`` ``[m, V]``: per row its ``k`` largest values, their token ids,
    ``token_ids[row]`` and its logprob, packed as ``[m, 2 * min(k, V) + 2]`` float64 (exact for
    fp32 values and token ids); device work only."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    tokens = token_ids.to(logp.device).long()[:, None]
    parts = [tokens.double(), logp.gather(1, tokens).double()]
    if k:
        values, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
        parts = [values.double(), ids.double(), *parts]
    return torch.cat(parts, dim=1)


def top_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[int | None]
) -> Logprobs:
    """Per row ``{token_id: logprob}`` of the ``k`` most likely tokens plus ``token_ids[row]``
    (``log_softmax`` of ``logits``), or ``None`` for rows whose ``k`` is ``None``; computed on
    the logits' device and read back when first accessed."""
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    ks = [int(num_logprobs[i] or 0) for i in rows]
    packed = None
    if rows:
        if len(rows) < len(num_logprobs):
            index = host_to_device(rows, logits.device).long()
            logits = logits.index_select(0, index)
            token_ids = token_ids.to(logits.device).index_select(0, index)
        packed = device_top_logprobs(logits, token_ids, max(ks))
    return Logprobs(len(num_logprobs), rows, ks, packed)
