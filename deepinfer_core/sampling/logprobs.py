"""Logprobs of sampled rows: computed on the device (:func:`device_top_logprobs`), read back
as per-row ``{token_id: logprob}`` dicts only when first accessed (:class:`Logprobs`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import torch

from deepinfer_core.sampling.transfer import HostCopy, host_to_device


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
        self._packed = HostCopy(packed) if packed is not None else None
        self._entries: list[dict[int, float] | None] | None = None

    def _materialize(self) -> list[dict[int, float] | None]:
        if self._entries is None:
            entries: list[dict[int, float] | None] = [None] * self._num_rows
            if self._packed is not None:
                values = self._packed.get().tolist()
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
