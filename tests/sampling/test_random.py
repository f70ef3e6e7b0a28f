"""Counter-based noise: a pure function of (seed, position, token id), checked against pure Python."""

from __future__ import annotations

import torch

from deepinfer_core.sampling.random import derive_seed, gumbel_noise, hash_u32, uniform_noise

M32 = 0xFFFFFFFF


def py_fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def py_hash(seed: int, position: int, token: int) -> int:
    """The same hash with Python's unbounded ints (no overflow possible): the oracle."""
    z = derive_seed(seed, position)
    k1, k2 = z & M32, (z >> 31) & M32
    h = ((token * 0x9E3779B1) + k1) & M32
    return py_fmix32(py_fmix32(h) ^ k2)


def test_torch_hash_equals_the_python_integer_oracle():
    seeds, positions = [0, 7, 2**62 + 5, 123456789], [0, 1, 99_999, 3]
    V = 3000
    h = hash_u32(seeds, positions, V)
    assert h.dtype == torch.int64 and int(h.min()) >= 0 and int(h.max()) <= M32
    for i, (s, p) in enumerate(zip(seeds, positions, strict=True)):
        for t in (0, 1, 2, 17, 1000, 2999):
            assert int(h[i, t]) == py_hash(s, p, t)


def test_hashes_within_a_row_are_distinct():
    h = hash_u32([42], [10], 50_000)[0]
    assert torch.unique(h).numel() == 50_000


def test_noise_is_a_function_of_seed_and_position_only():
    """Same (seed, position) -> identical noise whatever the other rows and the row order."""
    alone = gumbel_noise([5], [17], 500)
    batched = gumbel_noise([1, 5, 5, 9], [17, 18, 17, 0], 500)
    assert torch.equal(batched[2], alone[0])
    assert not torch.equal(batched[1], alone[0])  # next position
    assert not torch.equal(batched[0], alone[0])  # other seed


def test_noise_differs_across_positions_and_is_uncorrelated():
    V = 20_000
    u = uniform_noise([3] * 4, [0, 1, 2, 1000], V)
    assert ((u > 0) & (u < 1)).all()
    for i in range(3):
        assert (u[i] == u[i + 1]).float().mean() < 1e-3
    c = torch.corrcoef(u)
    off_diag = c[~torch.eye(4, dtype=torch.bool)]
    assert off_diag.abs().max() < 0.05  # |r| ~ 1/sqrt(V) = 0.007 for independent rows


def test_uniforms_are_uniform():
    u = uniform_noise(list(range(8)), [0] * 8, 50_000).flatten()
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    expected = u.numel() / 10
    assert ((counts - expected).abs() < 5 * expected**0.5).all(), counts


def test_gumbel_noise_has_the_gumbel_mean_and_variance():
    g = gumbel_noise(list(range(4)), [1] * 4, 100_000).flatten()
    euler_gamma = 0.5772156649
    assert abs(g.mean().item() - euler_gamma) < 0.01
    assert abs(g.var().item() - torch.pi**2 / 6) < 0.03
