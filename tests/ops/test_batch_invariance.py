"""Batch invariance of the ops: under ``batch_invariant_mode`` row ``i`` of an op on ``B`` rows
is bitwise the op on row ``i`` alone (and, for index lists, with other ``-1`` padding), for
every op the contract marks ``batch_invariant``.

Each check runs on three op tables: the reference on CPU, the ``cpu`` backend's table (its C++
kernels and the reference ops; skipped, with the reason, where the plugin is not installed or
cannot build them), and the ``cuda_sm100`` backend's table on a GPU (its kernels, the reference
ops it leaves to fall back, and the mode's GEMM on its ``tile_matmul``, as the engine runs them;
skipped, with the reason, without a GPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deepinfer_core.ops import OpTable, all_ops, get_op
from deepinfer_core.ops._cases import randn_fp4, randn_fp8
from deepinfer_core.ops.modes import batch_invariant_enabled, batch_invariant_mode
from deepinfer_core.ops.registry import is_extension
from deepinfer_core.testing.compare import to_device
from deepinfer_core.weights.quant import QuantizedTensor

BATCHES = (1, 2, 3, 4, 5, 7, 8, 16, 17, 31, 33, 64, 65, 130)
H, D, N_STREAMS, E, TOPK = 4, 32, 4, 8, 2


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def _indices(g: torch.Generator, t: int, n: int, width: int) -> torch.Tensor:
    idx = torch.randint(-1, n, (t, width), generator=g)
    idx[:, 0] = torch.randint(0, n, (t,), generator=g)
    return idx


# Per op: build (args, row-indexed argument positions) for a batch of t rows.  Row-indexed
# arguments are [t, ...] tensors or lists of them; the others are shared by every row.
Case = tuple[tuple, tuple[int, ...]]
CASES: dict[str, Callable[[torch.Generator, int], Case]] = {
    "rms_norm": lambda g, t: ((_randn(g, t, 64), 1 + _randn(g, 64, scale=0.1), 1e-6), (0,)),
    "linear": lambda g, t: ((_randn(g, t, 64), _randn(g, 200, 64, scale=0.1)), (0,)),
    # items as rows, each with its own weight
    "tile_matmul": lambda g, t: ((_randn(g, t, 64, 48), _randn(g, t, 40, 48, scale=0.1)), (0, 1)),
    "grouped_linear": lambda g, t: ((_randn(g, t, 2, 64), _randn(g, 2 * 16, 64, scale=0.1)), (0,)),
    "embedding": lambda g, t: ((torch.randint(0, 50, (t,), generator=g), _randn(g, 50, 32)), (0,)),
    "rope_cos_sin": lambda g, t: (
        (
            torch.randint(0, 5000, (t,), generator=g),
            1.0 / (1e4 ** (torch.arange(0, 8, 2) / 8.0)),
            1.0,
            torch.float32,
        ),
        (0,),
    ),
    "apply_rope": lambda g, t: ((_randn(g, t, H, D), _randn(g, t, 4), _randn(g, t, 4)), (0, 1, 2)),
    "qk_norm_rope": lambda g, t: (
        (
            _randn(g, t, H, D),
            _randn(g, t, D),
            1 + _randn(g, D, scale=0.1),
            1e-6,
            _randn(g, t, 4),
            _randn(g, t, 4),
        ),
        (0, 1, 4, 5),
    ),
    "sparse_attention": lambda g, t: (
        (
            _randn(g, t, H, D),
            [_randn(g, 40, D), _randn(g, 9, D)],
            [_indices(g, t, 40, 11), _indices(g, t, 9, 5)],
            _randn(g, H),
            D**-0.5,
        ),
        (0, 2),
    ),
    "compress_pool": lambda g, t: ((_randn(g, t, 8, D), _randn(g, t, 8, D)), (0, 1)),
    # window i writes pool row i (row 0 of its one-row pool alone: see _row)
    "compress_entries": lambda g, t: (
        (
            _randn(g, t, 8, D),
            _randn(g, t, 8, D),
            1 + _randn(g, D, scale=0.1),
            1e-6,
            torch.randint(0, 5000, (t,), generator=g) * 4,
            1.0 / (1e4 ** (torch.arange(0, 8, 2) / 8.0)),
            1.0,
            torch.zeros(t, D),
            torch.arange(t),
        ),
        (0, 1, 4, 7, 8),
    ),
    "indexer_topk": lambda g, t: (
        (_randn(g, t, 8, 16), _randn(g, t, 8), _randn(g, 30, 16), _indices(g, t, 30, 20), 4, 0.25),
        (0, 1, 3),
    ),
    "moe_route": lambda g, t: (
        (_randn(g, t, E), _randn(g, E, scale=0.1), None, TOPK, "sqrtsoftplus", 1.5),
        (0,),
    ),
    "moe_experts": lambda g, t: (
        (
            _randn(g, t, 64),
            torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(t)]),
            _randn(g, t, TOPK).abs(),
            _randn(g, E, 64, 64, scale=0.2),
            _randn(g, E, 64, 32, scale=0.2),
            10.0,
        ),
        (0, 1, 2),
    ),
    "swiglu": lambda g, t: ((_randn(g, t, 32, scale=4), _randn(g, t, 32, scale=4), 10.0), (0, 1)),
    # quarter steps: each row's maximum is tied many times (the first one wins)
    "argmax_rows": lambda g, t: ((torch.randint(-8, 8, (t, 5000), generator=g) / 4,), (0,)),
    "hc_pre": lambda g, t: (
        (
            _randn(g, t, N_STREAMS, 16),
            _randn(g, 24, 64, scale=0.1),
            _randn(g, 24),
            1 + _randn(g, 3, scale=0.1),
            1e-6,
            1e-6,
            20,
        ),
        (0,),
    ),
    "hc_post": lambda g, t: (
        (
            _randn(g, t, 16),
            _randn(g, t, N_STREAMS, 16),
            _randn(g, t, N_STREAMS).sigmoid(),
            _randn(g, t, N_STREAMS, N_STREAMS).softmax(-1),
        ),
        (0, 1, 2, 3),
    ),
    "hc_post_pre": lambda g, t: (
        (
            _randn(g, t, 16),
            _randn(g, t, N_STREAMS, 16),
            _randn(g, t, N_STREAMS).sigmoid(),
            _randn(g, t, N_STREAMS, N_STREAMS).softmax(-1),
            _randn(g, 24, 64, scale=0.1),
            _randn(g, 24),
            1 + _randn(g, 3, scale=0.1),
            1e-6,
            1e-6,
            20,
            1 + _randn(g, 16, scale=0.1),
        ),
        (0, 1, 2, 3),
    ),
    "hc_head": lambda g, t: (
        (
            _randn(g, t, N_STREAMS, 16),
            _randn(g, N_STREAMS, 64, scale=0.1),
            _randn(g, N_STREAMS),
            _randn(g, 1).abs(),
            1e-6,
            1e-6,
        ),
        (0,),
    ),
    "hc_head_norm": lambda g, t: (
        (
            _randn(g, t, N_STREAMS, 16),
            _randn(g, N_STREAMS, 64, scale=0.1),
            _randn(g, N_STREAMS),
            _randn(g, 1).abs(),
            1e-6,
            1e-6,
            1 + _randn(g, 16, scale=0.1),
        ),
        (0,),
    ),
}


TARGETS = [
    pytest.param(("reference", "cpu"), id="reference-cpu"),
    pytest.param(("cpu", "cpu"), id="cpu-cpu"),
    pytest.param(
        ("cuda_sm100", "cuda"),
        id="cuda_sm100-cuda",
        marks=pytest.mark.gpu,
    ),
]


@pytest.fixture(scope="module", params=TARGETS)
def target(request) -> tuple[OpTable, torch.device]:
    """``(op table, device)`` the checks run on."""
    backend, device = request.param
    if backend == "reference":
        return OpTable.reference(), torch.device(device)
    from deepinfer_core.plugins import get_plugins
    from deepinfer_core.testing.availability import backend_unavailable_reason

    if device == "cpu" and (reason := backend_unavailable_reason(backend)) is not None:
        pytest.skip(reason)
    return OpTable(get_plugins().get_backend(backend).load_ops(), backend=backend), torch.device(device)


def _row(args: tuple, rows: tuple[int, ...], i: int) -> tuple:
    """The arguments of row ``i`` alone; index lists get extra ``-1`` columns, so the row
    also sees different padding than in the batch."""
    out = list(args)
    for p in rows:
        a = args[p]
        if isinstance(a, list):  # sparse_attention's per-source index lists
            out[p] = [torch.cat([x[i : i + 1], torch.full((1, 3), -1)], dim=1) for x in a]
        elif a.dtype == torch.int64 and a.dim() == 2 and p == 3:  # indexer candidates
            out[p] = torch.cat([a[i : i + 1], torch.full((1, 70), -1)], dim=1)
        elif a.dtype == torch.int64 and a.dim() == 1 and p == 8:  # compress_entries' pool rows
            out[p] = torch.zeros(1, dtype=torch.int64)
        else:
            out[p] = a[i : i + 1]
    return tuple(out)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a non-contiguous view (as a split of a fused projection would be)."""
    if not x.is_floating_point() or x.dim() < 2:
        return x
    return torch.cat([x, x], dim=-1)[..., : x.shape[-1]]


def _rows_of(out, i: int):
    return tuple(o[i : i + 1] for o in out) if isinstance(out, tuple) else (out[i : i + 1],)


def test_every_batch_invariant_op_has_a_case():
    # extension ops (a plugin's ``namespace.op``) are checked by their plugin's own tests
    marked = {name for name, spec in all_ops().items() if spec.batch_invariant and not is_extension(name)}
    assert marked == set(CASES)


# The weight-taking ops with quantised weights (keep_quantized): dequantised, then the same tiles.
QUANTISED_CASES: dict[str, Callable[[torch.Generator, int], Case]] = {
    "linear": lambda g, t: ((_randn(g, t, 256), randn_fp8(g, 200, 256, scale=0.1)), (0,)),
    "grouped_linear": lambda g, t: (
        (_randn(g, t, 2, 128), randn_fp8(g, 2 * 64, 128, scale=0.1, block=(64, 128))),
        (0,),
    ),
    "moe_experts": lambda g, t: (
        (
            _randn(g, t, 64),
            torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(t)]),
            _randn(g, t, TOPK).abs(),
            randn_fp4(g, E, 64, 64, scale=0.2),
            randn_fp4(g, E, 64, 32, scale=0.2, scale_dtype="ue8m0"),
            10.0,
        ),
        (0, 1, 2),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_row_is_bitwise_independent_of_the_batch(name, target):
    _check_rows_independent_of_the_batch(name, CASES[name], *target)


@pytest.mark.parametrize("name", sorted(QUANTISED_CASES))
def test_op_row_is_bitwise_independent_of_the_batch_with_quantised_weights(name, target):
    _check_rows_independent_of_the_batch(name, QUANTISED_CASES[name], *target)


@pytest.mark.parametrize("name", sorted(QUANTISED_CASES))
def test_quantised_weights_give_bitwise_their_dequantised_values_in_the_mode(name):
    g = torch.Generator().manual_seed(2)
    fn = get_op(name).reference
    args, _ = QUANTISED_CASES[name](g, 37)
    plain = tuple(a.dequantize() if isinstance(a, QuantizedTensor) else a for a in args)
    with batch_invariant_mode():
        assert torch.equal(fn(*args), fn(*plain))


def _check_rows_independent_of_the_batch(
    name: str, make: Callable[[torch.Generator, int], Case], table: OpTable, device: torch.device
) -> None:
    g = torch.Generator().manual_seed(0)
    fn = table[name]
    args, rows = make(g, max(BATCHES))
    singles = [to_device(_row(args, rows, i), device) for i in range(max(BATCHES))]
    args = to_device(args, device)
    with batch_invariant_mode(matmul=table["tile_matmul"]):
        alone = [_rows_of(fn(*single), 0) for single in singles]
        for b in BATCHES:
            sub = tuple(
                [x[:b] for x in a]
                if p in rows and isinstance(a, list)
                else _strided(a[:b])
                if p in rows
                else a
                for p, a in enumerate(args)
            )
            out = fn(*sub)
            for i in range(b):
                for got, want in zip(_rows_of(out, i), alone[i], strict=True):
                    assert torch.equal(got, want), f"{name}: row {i} of a batch of {b} differs from alone"


def test_linear_rows_depend_on_the_batch_without_the_mode():
    """The property the mode buys is real: plain ``linear`` (one GEMM, shape-chosen kernel)
    gives row 0 different bits alone than in a batch of 8 on this CPU."""
    g = torch.Generator().manual_seed(0)
    (x, w), _ = CASES["linear"](g, 8)
    fn = get_op("linear").reference
    differs = [not torch.equal(fn(x[:b], w)[:1], fn(x[:1], w)) for b in (2, 3, 4, 8)]
    assert any(differs)


def test_mode_is_scoped_and_restores_threads():
    threads = torch.get_num_threads()
    assert not batch_invariant_enabled()
    with batch_invariant_mode():
        assert batch_invariant_enabled()
        assert torch.get_num_threads() == 1
        with batch_invariant_mode(False):
            assert not batch_invariant_enabled()
    assert not batch_invariant_enabled()
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize(
    ("name", "quantised"), [(n, False) for n in sorted(CASES)] + [(n, True) for n in sorted(QUANTISED_CASES)]
)
def test_invariant_mode_stays_close_to_the_normal_path(name, quantised):
    g = torch.Generator().manual_seed(1)
    fn = get_op(name).reference
    args, _ = (QUANTISED_CASES if quantised else CASES)[name](g, 37)
    as_tuple = lambda o: o if isinstance(o, tuple) else (o,)  # noqa: E731
    normal = tuple(o.clone() for o in as_tuple(fn(*args)))  # a copy: an op may return its (in-place) cache
    with batch_invariant_mode():
        inv = fn(*args)
    for a, b in zip(as_tuple(normal), as_tuple(inv), strict=True):
        if a.is_floating_point():
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        elif name == "indexer_topk":  # the mode returns the same picks in column order
            assert torch.equal(a.sort(-1).values, b.sort(-1).values)
        else:
            assert torch.equal(a, b)
