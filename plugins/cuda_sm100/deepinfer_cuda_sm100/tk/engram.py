"""TileKernels' Engram kernels as V4.1's ``deepseek_v41.engram_hash`` and ``deepseek_v41.engram_mix``.

- ``engram_hash``: TileKernels' ``engram_hash`` (one layer): ``h_n = XOR_s (tokens[:, s] *
  multipliers[s])`` in int64, ``h_n % prime + offset`` per (n-gram, head).  It reads int32 token
  ids, bucket sizes and offsets and writes int32 rows; the adapter converts (the release's
  compressed ids, primes and table rows are all below ``2**31``: a table of more rows would not
  fit the kernel's int32 output) and widens the rows to the contract's int64.  The products are
  non-negative, so C's ``%`` is the contract's.
- ``engram_mix``: ``engram_gate_fwd`` (inference: nothing saved for a backward), with the fused
  weight ``q_weight * k_weight`` (float32) and clamp ``1e-6``: per stream ``dot = sum(h * w * k)
  * rsqrt(mean(h^2) + eps) * rsqrt(mean(k^2) + eps) / sqrt(D)``, ``gate = sigmoid(sign(dot) *
  sqrt(max(|dot|, 1e-6)))``, ``h + gate * value`` in float32.  bfloat16 only; ``D`` a multiple of
  a 256..1024 block with at least two blocks (the kernel's pipeline).
"""

from __future__ import annotations

import torch

from deepinfer_cuda_sm100.tk import Adapter, ChoiceKey, Verdict, device_last, dtype_name, first_problem

GATE_CLAMP = 1e-6
"""The contract's floor of ``|dot|`` under the signed square root."""


def engram_hash(tokens, multipliers, primes, offsets):
    """``deepseek_v41.engram_hash`` through TileKernels' ``engram_hash`` (see the module docstring)."""
    from tile_kernels.engram import engram_hash as tk_engram_hash

    t, n = tokens.shape
    heads = primes.shape[0] // (n - 1)
    i32 = torch.int32
    rows = tk_engram_hash(
        tokens.to(i32).contiguous(),
        multipliers.to(torch.int64).reshape(1, n).contiguous(),
        primes.to(i32).reshape(1, n - 1, heads).contiguous(),
        offsets.to(i32).reshape(1, (n - 1) * heads).contiguous(),
    )
    return rows[0].to(torch.int64)


@device_last
def hash_supports(tokens, multipliers, primes, offsets) -> Verdict:
    ok = first_problem(
        (
            tokens.dim() == 2 and tokens.shape[1] >= 2,
            f"tokens has shape {tuple(tokens.shape)}, expected [T, N>=2]",
        ),
        *(
            (not t.is_floating_point(), f"{name} dtype {t.dtype} is not an integer dtype")
            for name, t in (
                ("tokens", tokens),
                ("multipliers", multipliers),
                ("primes", primes),
                ("offsets", offsets),
            )
        ),
    )
    if ok is not True:
        return ok
    n = tokens.shape[1]
    return first_problem(
        (
            tuple(multipliers.shape) == (n,),
            f"multipliers has shape {tuple(multipliers.shape)}, expected ({n},)",
        ),
        (
            primes.dim() == 1 and primes.shape[0] % (n - 1) == 0 and primes.shape[0] > 0,
            "primes is not [(N-1)*heads]",
        ),
        (tuple(offsets.shape) == tuple(primes.shape), "offsets and primes differ in shape"),
    )


def hash_key(tokens, multipliers, primes, offsets) -> ChoiceKey:
    t, n = tokens.shape
    return ChoiceKey("hash", dtype_name(tokens.dtype), n, primes.shape[0], t)


def _block(d: int) -> int | None:
    """The kernel's channel block for width ``d`` (its own rule), or ``None``."""
    return next((b for b in (1024, 768, 512, 256) if d % b == 0 and d >= 2 * b), None)


def engram_mix(streams, kv, q_weight, k_weight, eps):
    """``deepseek_v41.engram_mix`` through ``engram_gate_fwd`` (see the module docstring)."""
    from tile_kernels.engram import engram_gate_fwd

    t, n, d = streams.shape
    weight = (q_weight.to(torch.float32) * k_weight.to(torch.float32)).contiguous()
    out, *_ = engram_gate_fwd(
        streams.contiguous(),
        kv.contiguous().view(t, n + 1, d),
        weight,
        float(eps),
        GATE_CLAMP,
        save_for_backward=False,
    )
    return out


@device_last
def mix_supports(streams, kv, q_weight, k_weight, eps) -> Verdict:
    ok = first_problem(
        (streams.dim() == 3, f"streams has {streams.dim()} dims, expected [T, N, D]"),
        (streams.dtype == torch.bfloat16, f"streams dtype {streams.dtype}: TileKernels' gate takes bfloat16"),
        (kv.dtype == streams.dtype, f"kv dtype {kv.dtype} differs from streams'"),
    )
    if ok is not True:
        return ok
    t, n, d = streams.shape
    return first_problem(
        (tuple(kv.shape) == (t, (n + 1) * d), f"kv has shape {tuple(kv.shape)}, expected {(t, (n + 1) * d)}"),
        (
            tuple(q_weight.shape) == (n, d) == tuple(k_weight.shape),
            f"q_weight and k_weight must be [{n}, {d}]",
        ),
        (
            _block(d) is not None,
            f"D={d}: the kernel takes multiples of a 256..1024 block, at least two blocks",
        ),
    )


def mix_key(streams, kv, q_weight, k_weight, eps) -> ChoiceKey:
    t, n, d = streams.shape
    return ChoiceKey("gate", dtype_name(streams.dtype), n, d, t)


ADAPTERS = (
    Adapter(
        "deepseek_v41.engram_hash",
        engram_hash,
        hash_supports,
        hash_key,
        ("engram_hash",),
        row_independent=True,
    ),
    Adapter(
        "deepseek_v41.engram_mix",
        engram_mix,
        mix_supports,
        mix_key,
        ("engram_gate_fwd",),
        row_independent=True,
    ),
)
