"""Engram conditional memory of DeepSeek-V4.1: the hashing layout, fixed by the config and tokenizer.

At each Engram layer a position looks up, for every n-gram size ``n = 2..N``
(``engram_max_ngram_size``) and each of ``engram_n_heads`` heads, one row of the layer's table:

- token ids are first *normalised*: every id of the tokenizer maps to a compressed id, tokens
  whose text normalises alike (NFKC, NFD, accents stripped, lower case, whitespace runs folded,
  stripped) sharing one (:func:`compressed_token_map`; ``engram_compressed_vocab_size`` ids);
- the ``N`` compressed ids ending at the position (itself and ``N - 1`` look-back ids; ``engram_pad_id``
  's compressed id before the sequence start) are multiplied by the layer's odd multipliers
  (:func:`hash_multipliers`: numpy's PCG64 seeded ``10007 * layer``, as the training code) and
  XOR-ed one by one; after ``n`` of them the running value is the ``n``-gram's hash;
- the hash modulo the (layer, n, head) prime gives the row inside that pair's bucket range; the
  ranges are laid out one after another (:class:`EngramLayout`), primes drawn in order above
  ``engram_vocab_size`` and never reused, so a layer's table has ``sum(primes)`` rows
  (``engram_num_embeddings``).

This module only derives the constants; the per-step hashing is the ``deepseek_v41.engram_hash``
op and the look-back ids are carried per sequence slot by the model's cache
(:mod:`.model`).  The table is read by ``deepseek_v41.engram_mix``'s caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deepinfer_core.errors import ConfigError

from .config import DeepseekV41Config


def is_prime(n: int) -> bool:
    """Deterministic primality (trial division by 6k +- 1; the primes here are ~1.6e7)."""
    if n < 2:
        return False
    if n % 2 == 0 or n % 3 == 0:
        return n in (2, 3)
    k = 5
    while k * k <= n:
        if n % k == 0 or n % (k + 2) == 0:
            return False
        k += 6
    return True


@dataclass(frozen=True)
class EngramLayout:
    """The primes of every (Engram layer, n-gram size, head) and each layer's bucket offsets.

    Attributes:
        layers: the Engram layers, in order.
        primes: ``[L][N - 1][heads]``; offsets: ``[L][(N - 1) * heads]`` (n-gram-major) where each
            pair's range starts in its layer's table; rows: ``[L]`` table rows (sum of the primes).
    """

    layers: tuple[int, ...]
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    rows: tuple[int, ...]

    @classmethod
    def from_config(cls, cfg: DeepseekV41Config) -> EngramLayout:
        seen: set[int] = set()
        primes, offsets, rows = [], [], []
        for _ in cfg.engram_layer_ids:
            per_n = []
            for _ in range(cfg.engram_max_ngram_size - 1):
                current, heads = cfg.engram_vocab_size - 1, []
                for _ in range(cfg.engram_n_heads):
                    current += 1
                    while current in seen or not is_prime(current):
                        current += 1
                    seen.add(current)
                    heads.append(current)
                per_n.append(tuple(heads))
            flat = [p for heads in per_n for p in heads]
            offsets.append(tuple(int(x) for x in np.cumsum([0, *flat[:-1]])))
            primes.append(tuple(per_n))
            rows.append(sum(flat))
        return cls(tuple(cfg.engram_layer_ids), tuple(primes), tuple(offsets), tuple(rows))

    def check(self, cfg: DeepseekV41Config, source: str = "config") -> None:
        """``engram_num_embeddings`` must be the layout's table sizes (the tables are addressed by it)."""
        if list(self.rows) != list(cfg.engram_num_embeddings):
            raise ConfigError(
                f"{source}: engram_num_embeddings {cfg.engram_num_embeddings} does not match the hash "
                f"layout's table sizes {list(self.rows)} (primes above engram_vocab_size "
                f"{cfg.engram_vocab_size}, "
                f"{cfg.engram_max_ngram_size - 1} n-gram sizes x {cfg.engram_n_heads} heads per layer)"
            )


def hash_multipliers(
    layers: tuple[int, ...] | list[int], max_ngram: int, compressed_vocab: int
) -> torch.Tensor:
    """``[L, max_ngram]`` int64 odd multipliers, one row per Engram layer: numpy's default generator
    seeded ``10007 * layer``, integers below ``(int64 max // compressed_vocab) // 2``, times 2 plus 1
    (so ``id * multiplier`` never overflows)."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = []
    for layer in layers:
        values = np.random.default_rng(10007 * layer).integers(
            low=0, high=bound, size=(max_ngram,), dtype=np.int64
        )
        rows.append(torch.from_numpy(values * 2 + 1))
    return torch.stack(rows)


def compressed_token_map(tokenizer_file: str | Path) -> tuple[torch.Tensor, int]:
    """``(map [len(tokenizer)] int64, compressed vocabulary size)`` of a ``tokenizer.json``.

    Each token's text (decoded alone, special tokens kept) is normalised; tokens with equal
    normalised text share an id, numbered in order of first appearance.  A token that decodes
    to a partial UTF-8 sequence keys by its raw token string; one that normalises to nothing
    keeps its text.  A text of exactly one space is kept (not stripped to nothing).
    """
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(str(tokenizer_file))
    sentinel = "\ue000"
    norm = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    n = tok.get_vocab_size(with_added_tokens=True)
    ids: dict[str, int] = {}
    out = torch.empty(n, dtype=torch.int64)
    for t in range(n):
        text = tok.decode([t], skip_special_tokens=False)
        key = (tok.id_to_token(t) or "") if "\ufffd" in text else (norm.normalize_str(text) or text)
        out[t] = ids.setdefault(key, len(ids))
    return out, len(ids)


def token_map_for_vocab(token_map: torch.Tensor, vocab_size: int, pad: int) -> torch.Tensor:
    """The map extended to the model's ``vocab_size`` ids: ids the tokenizer does not have (the
    model may still emit them) map to the pad token's compressed id."""
    if token_map.shape[0] >= vocab_size:
        return token_map[:vocab_size].clone()
    extra = torch.full((vocab_size - token_map.shape[0],), int(token_map[pad]), dtype=torch.int64)
    return torch.cat([token_map, extra])
