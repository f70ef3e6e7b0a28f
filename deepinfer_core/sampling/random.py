"""Counter-based randomness: noise that is a pure function of (seed, position, token id).

A sampled token must not depend on which other requests share the step, on the request's row,
on how its prompt was chunked, on async scheduling or on a preemption that recomputes it.  A
stateful generator shared by (or even owned by) a request breaks some of these: a recompute
after preemption would draw again.  Instead every draw is a hash of

    (request seed, absolute position of the token being sampled, token id)

turned into a uniform ``u`` in (0, 1) and then into Gumbel noise ``-log(-log(u))``.  The sampler
takes ``argmax(logits / T + gumbel)`` over the tokens that survive filtering, which is an exact
sample of the renormalised filtered distribution (the Gumbel-max trick).

The hash is computed elementwise in int64 torch ops on the logits' device: the row key (two
32-bit words from SplitMix64 of seed and position, computed on the host from host data and
shipped with the step's other sampling parameters) is mixed with the token id by two rounds of
MurmurHash3's 32-bit finaliser.  32-bit products are split into 16-bit halves and masked so
that no int64 operation overflows, on any device.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


def derive_seed(base: int, index: int) -> int:
    """A 63-bit seed mixed from ``(base, index)`` with SplitMix64, so that nearby bases and indices
    give unrelated streams (``derive_seed(1, 1) != derive_seed(2, 0)``)."""
    z = (base * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def row_keys(seeds: list[int], positions: list[int]) -> tuple[list[int], list[int]]:
    """Two independent 32-bit keys per row, from ``(seed, position)`` (host-side, O(rows))."""
    k1, k2 = [], []
    for s, p in zip(seeds, positions, strict=True):
        z = derive_seed(s, p)
        k1.append(z & _MASK32)
        k2.append((z >> 31) & _MASK32)
    return k1, k2


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """``(a * b) mod 2**32`` for ``a`` in [0, 2**32) (int64) without int64 overflow."""
    lo = a * (b & 0xFFFF)  # < 2**48
    hi = ((a * (b >> 16)) & 0xFFFF) << 16  # only the low 16 bits of the high product matter
    return (lo + hi) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (a bijection of [0, 2**32)), on int64 tensors."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def hash_u32(
    seeds: list[int], positions: list[int], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """32-bit hashes ``[B, V]`` (int64 values in [0, 2**32)) of (seed, position, token id).

    Row ``i`` depends only on ``seeds[i]`` and ``positions[i]``; within a row, distinct token ids
    give distinct hashes (both mixing steps are bijections for a fixed key).
    """
    k1, k2 = row_keys(seeds, positions)
    key1 = torch.tensor(k1, dtype=torch.int64, device=device)
    key2 = torch.tensor(k2, dtype=torch.int64, device=device)
    return hash_u32_from_keys(key1, key2, vocab_size)


def hash_u32_from_keys(key1: torch.Tensor, key2: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """:func:`hash_u32` from the rows' keys (:func:`row_keys`) already on the device: ``[B]``
    int64 each.  Pure device work (no host sync), so it can run inside a captured step."""
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=key1.device)[None, :]
    h = (_mul32(tokens, 0x9E3779B1) + key1[:, None]) & _MASK32
    h = _fmix32(h)
    return _fmix32(h ^ key2[:, None])


def uniform_noise(
    seeds: list[int], positions: list[int], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Uniforms ``[B, V]`` float64 in the open interval (0, 1): ``(hash + 0.5) / 2**32``."""
    return _uniform(hash_u32(seeds, positions, vocab_size, device))


def gumbel_noise(
    seeds: list[int], positions: list[int], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Standard Gumbel noise ``[B, V]`` float64, ``-log(-log(u))`` of :func:`uniform_noise`."""
    return _gumbel(uniform_noise(seeds, positions, vocab_size, device))


def gumbel_noise_from_keys(key1: torch.Tensor, key2: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """:func:`gumbel_noise` from the rows' keys on the device (bitwise the same values)."""
    return _gumbel(_uniform(hash_u32_from_keys(key1, key2, vocab_size)))


def _uniform(h: torch.Tensor) -> torch.Tensor:
    return (h.double() + 0.5) / 2.0**32


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u))
