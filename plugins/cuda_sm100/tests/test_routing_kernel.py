"""The ``cuda_sm100`` routing kernel (``moe_route``) against the reference.

**Interpreter.**  ``TRITON_INTERPRET=1`` must be set before Triton is imported and must not
leak into this pytest process, so the interpreter checks run in a child: ``python
test_routing_kernel.py --interpreter-report`` prints a JSON report and each test below reads
one part of it.  It runs

- the conformance suite (``check_backend``) on a CPU ``BackendSpec`` holding the op: the core's
  cases and the kernel's (:data:`deepinfer_cuda_sm100.routing_ops.SMALL`: 256 experts, top-6;
  every scoring function, with and without the correction bias, strided logits, hash routing,
  exact ties) in float32, bfloat16 and float16, in the default and the batch-invariant mode
  (ids must equal the reference's exactly, weights within the op's tolerances);
- the launches: expert counts that are not powers of two, one expert, 384 experts, top-k of 1,
  3, 5, 8, 16 and ``k = E``, softmax over fewer than 32 lanes, transposed logits, int32 hash ids,
  no tokens;
- the numerics, bitwise: the kernel against :func:`emulated`, the reference's op sequence in
  torch with correctly rounded ``exp`` / ``log1p`` (what the interpreter computes; PyTorch's CPU
  kernels use SLEEF, within an ulp, so the reference itself can differ in the last bit) and the
  kernel's documented summation orders (PyTorch's CUDA ones);
- ties and special values against the reference and against the expected picks: equal scores
  (lower ids first), tied biases, ``-inf`` biases, NaN logits (picked first, as ``torch.sort``
  orders them), zero scores;
- batch invariance (bitwise): a token's weights and ids computed alone or within batches of
  several sizes, with strided logits.

**Compile** (no GPU needed): the kernel compiles for sm_90 and sm_100 through Triton's NVIDIA
backend for every scoring function, with the IEEE divisions and square roots and without
libdevice's flush to zero.

**GPU** (skipped without CUDA): conformance at :data:`~deepinfer_cuda_sm100.routing_ops.V4_FLASH_LIKE`,
the launches, ties and invariance, V4-Flash shapes up to 4096 tokens against the reference, the
scores and weights bit for bit against PyTorch's CUDA kernels in float32, and the replay of a
captured CUDA graph.
"""

from __future__ import annotations

import json
import os
import sys

import cuda_sm100_checks as checks
import pytest
import torch
from cuda_sm100_checks import compile_problem, compile_typed, failed_rows, global_loads_around

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

import triton  # noqa: E402  (after the skip: the kernels need it)
import triton.language as tl  # noqa: E402
from deepinfer_cuda_sm100.kernels._common import cast_to  # noqa: E402
from deepinfer_cuda_sm100.kernels.routing import _scores  # noqa: E402

OP = "moe_route"
SCORINGS = ("sqrtsoftplus", "sigmoid", "softmax")


@triton.jit
def _score_rows(
    x_ptr,
    stride_x,
    out_ptr,
    n_rows,
    E: tl.constexpr,
    SCORING_FN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    LANES: tl.constexpr,
):
    """The kernel's scores of ``[n_rows, E]`` logits (contiguous along E), in ``out``'s dtype."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK_E)
    dtype = out_ptr.dtype.element_ty
    s = _scores(x_ptr + rows[:, None] * stride_x, 1, row_ok, E, SCORING_FN, dtype, BLOCK_T, BLOCK_E, LANES)
    mask = row_ok[:, None] & (cols < E)[None, :]
    tl.store(out_ptr + rows[:, None] * E + cols[None, :], cast_to(s, dtype), mask=mask)


def score_rows(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """The scores the kernel computes for ``logits`` (``[T, E]``), as the reference's ``scores``."""
    from deepinfer_cuda_sm100.kernels import routing
    from deepinfer_cuda_sm100.kernels._common import cdiv, pow2

    logits = logits.contiguous()
    t, e = logits.shape
    out = torch.empty_like(logits)
    block_e, block_t = pow2(e), routing.block_rows(e)
    _score_rows[(cdiv(t, block_t),)](
        logits,
        logits.stride(0),
        out,
        t,
        E=e,
        SCORING_FN=routing.SCORING[scoring],
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        LANES=min(block_e, 32),
        enable_reflect_ftz=False,
    )
    return out


# ---------------------------------------------------------------------------------------------
# checks shared by the interpreter child and the GPU tests


def _impl():
    from deepinfer_cuda_sm100.routing_ops import routing_ops

    return routing_ops()[OP]


def _reference(*args):
    from deepinfer_core.ops.moe import moe_route

    return moe_route(*args)


def _conformance(device: str, dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    """The conformance suite on the op alone, in the default and the batch-invariant mode."""
    from cuda_sm100_checks import op_conformance_rows

    return op_conformance_rows("cuda_sm100_routing", OP, _impl, device, dtypes)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cuda_sum(w: torch.Tensor) -> torch.Tensor:
    """fp32 row sums of ``w`` ``[T, k]`` in the order of PyTorch's CUDA ``sum(-1)`` (and the
    kernel's): ``B`` = largest power of two <= k lanes, lane x adds slots x and x + B, then
    adjacent lanes pairwise."""
    k = w.shape[1]
    b = 1 << (k.bit_length() - 1)
    acc = w[:, :b].clone()
    acc[:, : k - b] += w[:, b:]
    while acc.shape[1] > 1:
        acc = acc[:, 0::2] + acc[:, 1::2]
    return acc[:, 0]


def _softmax_sum(e: torch.Tensor) -> torch.Tensor:
    """fp32 row sums of ``e`` ``[T, E]`` in the order of PyTorch's CUDA warp softmax: lane l of
    ``W = min(pow2(E), 32)`` adds ``e[l], e[l + W], ...``, then lanes ``l`` and ``l + W/2``, ..."""
    t, n = e.shape
    p = _pow2(n)
    w = min(p, 32)
    lanes = torch.nn.functional.pad(e, (0, p - n)).view(t, p // w, w)
    acc = lanes[:, 0].clone()
    for it in range(1, p // w):
        acc = acc + lanes[:, it]
    while acc.shape[1] > 1:
        h = acc.shape[1] // 2
        acc = acc[:, :h] + acc[:, h:]
    return acc[:, 0]


def emulated_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """The reference's scores with correctly rounded ``exp`` / ``log1p`` (float64, rounded to
    fp32), IEEE square roots (PyTorch's CPU ``sqrt`` is not always correctly rounded; CUDA's is)
    and the warp-softmax order: what the kernel computes in the interpreter (fp32, holding
    values of ``logits``' dtype)."""
    dt = logits.dtype

    def r(v: torch.Tensor) -> torch.Tensor:
        return v.to(dt).float()

    def exp(v: torch.Tensor) -> torch.Tensor:
        return torch.exp(v.double()).float()

    x = logits.float()
    if scoring == "sqrtsoftplus":
        y = exp(x)
        lp = torch.where(y < 2.0**-30, y, torch.log(y.double() + 1.0).float())
        return r(torch.sqrt(r(torch.where(x > 20.0, x, lp)).double()).float())  # IEEE sqrt
    if scoring == "sigmoid":
        return r(1.0 / (1.0 + exp(-x)))
    e = exp(x - x.max(dim=-1, keepdim=True).values)
    return r(e / _softmax_sum(e)[:, None])


def emulated(logits, correction_bias, fixed_ids, top_k, scoring, routed_scale):
    """``moe_route`` as the kernel computes it in the interpreter (see :func:`emulated_scores`;
    the sum of the chosen scores in PyTorch's CUDA order)."""
    dt = logits.dtype
    s = emulated_scores(logits, scoring)
    if fixed_ids is None:
        biased = s + correction_bias if correction_bias is not None else s
        ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]
    else:
        ids = fixed_ids.long()
    w = s.gather(1, ids)
    den = (_cuda_sum(w).to(dt).float() + 1e-20).to(dt).float()
    q = (w / den[:, None]).to(dt).float()
    return (q * torch.tensor(routed_scale, dtype=torch.float32)).to(dt), ids


def _args(g, t, e, k, scoring, *, bias=True, hashed=False, dtype=torch.float32, fixed_dtype=torch.int64):
    logits = (torch.randn(t, e, generator=g) * 2).to(dtype)
    b = torch.randn(e, generator=g) * 0.3 if bias else None
    fixed = None
    if hashed:
        fixed = torch.randint(0, e, (t, k), generator=g).to(fixed_dtype)
    return [logits, b, fixed, k, scoring, 1.5]


def _to(args, device: str) -> list:
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def _compare(label: str, got, want, dtype: torch.dtype, exact_weights: bool = False) -> list[str]:
    """ids equal, weights equal (``exact_weights``) or within the op's tolerances."""
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    (gw, gi), (ww, wi) = got, want
    if gw.shape != ww.shape or gi.shape != wi.shape:
        shapes = f"{tuple(gw.shape)} / {tuple(gi.shape)}, want {tuple(ww.shape)} / {tuple(wi.shape)}"
        return [f"{label}: shapes {shapes}"]
    problems = []
    if gi.dtype != torch.int64 or gw.dtype != ww.dtype:
        problems.append(f"{label}: dtypes {gw.dtype} / {gi.dtype}, want {ww.dtype} / int64")
    if not torch.equal(gi.cpu(), wi.cpu()):
        rows = (gi.cpu() != wi.cpu()).any(dim=1).nonzero().reshape(-1).tolist()
        problems.append(
            f"{label}: ids differ in rows {rows[:8]}: {gi[rows[0]].tolist()} != {wi[rows[0]].tolist()}"
        )
    gw, ww = gw.float().cpu(), ww.float().cpu()
    if exact_weights:
        ok = torch.equal(gw.nan_to_num(123.0), ww.nan_to_num(123.0)) and torch.equal(gw.isnan(), ww.isnan())
    else:
        atol, rtol = DEFAULT_TOLERANCES[dtype]
        ok = torch.allclose(gw, ww, atol=atol, rtol=rtol, equal_nan=True)
    if not ok:
        err = (gw - ww).abs().nan_to_num(0.0).max().item()
        problems.append(
            f"{label}: weights differ (max abs err {err:.3g}{', bitwise asked' if exact_weights else ''})"
        )
    return problems


LAUNCHES = (
    # (label, T, E, k, scoring, bias, hashed)
    ("E=8 top-2", 5, 8, 2, "sqrtsoftplus", True, False),
    ("E=72, not a power of two", 9, 72, 6, "sigmoid", True, False),
    ("E=384 top-8 softmax", 3, 384, 8, "softmax", False, False),
    ("E=384 top-8 sqrtsoftplus", 3, 384, 8, "sqrtsoftplus", True, False),
    ("softmax over 16 lanes", 7, 16, 3, "softmax", True, False),
    ("softmax over 5 experts", 4, 5, 2, "softmax", False, False),
    ("one expert", 4, 1, 1, "sqrtsoftplus", True, False),
    ("top-1", 6, 64, 1, "sigmoid", True, False),
    ("top-3", 6, 64, 3, "sqrtsoftplus", False, False),
    ("top-5", 6, 64, 5, "softmax", True, False),
    ("top-16", 3, 64, 16, "sqrtsoftplus", True, False),
    ("k = E", 3, 12, 12, "sigmoid", True, False),
    ("many tokens, E=32", 130, 32, 6, "sqrtsoftplus", True, False),
    ("hash top-8, int64", 5, 40, 8, "sqrtsoftplus", False, True),
    ("no tokens", 0, 256, 6, "sqrtsoftplus", True, False),
)


def launch_problems(dtype: torch.dtype, device: str) -> list[str]:
    """Each launch of :data:`LAUNCHES` (and transposed logits, int32 hash ids) against the reference."""
    impl = _impl()
    g = torch.Generator().manual_seed(5)
    problems = []
    runs = []
    for label, t, e, k, scoring, bias, hashed in LAUNCHES:
        runs.append((label, _args(g, t, e, k, scoring, bias=bias, hashed=hashed, dtype=dtype)))
    args = _args(g, 7, 48, 4, "sigmoid", dtype=dtype)
    args[0] = (torch.randn(48, 7, generator=g) * 2).to(dtype).t()  # stride along E != 1
    runs.append(("transposed logits", args))
    runs.append(
        (
            "hash top-4, int32",
            _args(g, 6, 64, 4, "softmax", hashed=True, dtype=dtype, fixed_dtype=torch.int32),
        )
    )
    for label, args in runs:
        args = _to(args, device)
        verdict = impl.supports(*args)
        if verdict is not True:
            problems.append(f"{label}: refused: {verdict}")
            continue
        problems += _compare(f"{label} {dtype}", impl.fn(*args), _reference(*args), dtype)
    return problems


def numerics_problems(device: str) -> list[str]:
    """Interpreter: the kernel bit for bit against :func:`emulated` (and its scores against
    :func:`emulated_scores`), every scoring function and dtype, with and without the bias."""
    impl = _impl()
    g = torch.Generator().manual_seed(9)
    problems = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for scoring in SCORINGS:
            for bias, hashed in ((True, False), (False, False), (False, True)):
                args = _to(_args(g, 13, 256, 6, scoring, bias=bias, hashed=hashed, dtype=dtype), device)
                label = f"{scoring} {dtype} bias={bias} hash={hashed}"
                problems += _compare(label, impl.fn(*args), emulated(*args), dtype, exact_weights=True)
            x = (torch.randn(13, 256, generator=g) * 8).to(dtype).to(device)  # past the softplus threshold
            if not torch.equal(score_rows(x, scoring), emulated_scores(x, scoring).to(dtype)):
                problems.append(f"{scoring} {dtype}: scores differ from the emulation")
    return problems


def _ties(device: str) -> list[tuple[str, list, list[list[int]] | None]]:
    """``(label, args, expected ids or None)``: equal scores and special values."""
    e, k, t = 64, 6, 3
    out = []
    flat = torch.zeros(t, e)
    out.append(("equal scores", [flat, None, None, k, "sqrtsoftplus", 1.0], [list(range(k))] * t))
    bias = torch.where(torch.arange(e) % 7 == 3, 0.5, 0.0)
    out.append(("tied biases", [flat, bias, None, k, "sigmoid", 1.0], [[3, 10, 17, 24, 31, 38]] * t))
    bias = torch.full((e,), float("-inf"))
    bias[[40, 9]] = 0.0
    out.append(("-inf biases", [flat, bias, None, 4, "sqrtsoftplus", 1.0], [[9, 40, 0, 1]] * t))
    nan = torch.randn(t, e, generator=torch.Generator().manual_seed(2))
    nan[:, 5] = float("nan")
    out.append(("NaN logit", [nan, None, None, k, "sqrtsoftplus", 1.0], None))
    zeros = torch.full((t, e), float("-inf"))  # sigmoid scores +0.0; biases -0.0 / +0.0
    signed = torch.where(torch.arange(e) % 2 == 0, -0.0, 0.0)
    out.append(
        ("zero scores, signed zero biases", [zeros, signed, None, k, "sigmoid", 1.0], [list(range(k))] * t)
    )
    levels = torch.randint(-2, 3, (t, e), generator=torch.Generator().manual_seed(3)).float() / 2
    out.append(("five levels", [levels, None, None, k, "softmax", 1.0], None))
    return [(label, _to(args, device), want) for label, args, want in out]


def tie_problems(device: str) -> list[str]:
    """Ties and special values against the reference and the expected picks (lower ids first)."""
    impl = _impl()
    problems = []
    for dtype in (torch.float32, torch.bfloat16):
        for label, args, want in _ties(device):
            args = [args[0].to(dtype), *args[1:]]
            verdict = impl.supports(*args)
            if verdict is not True:
                problems.append(f"{label}: refused: {verdict}")
                continue
            got = impl.fn(*args)
            problems += _compare(f"{label} {dtype}", got, _reference(*args), dtype)
            if want is not None and got[1].cpu().tolist() != want:
                problems.append(f"{label} {dtype}: ids {got[1].cpu().tolist()}, want {want}")
    return problems


def invariance_problems(dtype: torch.dtype, device: str, tokens: int) -> list[str]:
    """A token's weights and ids are bitwise the same computed alone and in batches of several
    sizes (other rows of other programs), with strided logits (batch-invariant mode)."""
    from deepinfer_core.ops.modes import batch_invariant_mode

    fn = _impl().fn
    g = torch.Generator().manual_seed(4)
    problems = []
    configs = (
        ("sqrtsoftplus", True, False),
        ("sigmoid", True, False),
        ("softmax", False, False),
        ("sqrtsoftplus", False, True),
    )
    with batch_invariant_mode():
        for scoring, bias, hashed in configs:
            args = _to(_args(g, tokens, 256, 6, scoring, bias=bias, hashed=hashed, dtype=dtype), device)
            logits, b, fixed = args[:3]
            t = logits.shape[0]
            rows = sorted({0, 1, 2, t - 3, t - 2, t - 1} & set(range(t)))

            def call(lo, hi, logits=logits, b=b, fixed=fixed, rest=args[3:]):
                return fn(logits[lo:hi], b, None if fixed is None else fixed[lo:hi], *rest)

            alone = {i: call(i, i + 1) for i in rows}
            for n in sorted({2, 7, t} & set(range(1, t + 1))):
                wide = torch.cat([logits[:n], logits[:n]], dim=1)[:, : logits.shape[1]]  # strided rows
                out = fn(wide, b, None if fixed is None else fixed[:n], *args[3:])
                for i in (i for i in rows if i < n):
                    for name, x, y in zip(("weights", "ids"), out, alone[i], strict=True):
                        if not torch.equal(x[i : i + 1], y):
                            problems.append(
                                f"{scoring} bias={bias} hash={hashed}: row {i} {name} differ in {n} rows"
                            )
    return problems


# ---------------------------------------------------------------------------------------------
# the interpreter child


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import warnings

    from deepinfer_cuda_sm100.kernels import _common

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy: exp overflow to inf, as meant
    report: dict = {"interpreted": _common.INTERPRETED}
    report["conformance"] = _conformance("cpu", (torch.float32, torch.bfloat16, torch.float16))
    report["launches"] = launch_problems(torch.float32, "cpu") + launch_problems(torch.bfloat16, "cpu")
    report["numerics"] = numerics_problems("cpu")
    report["ties"] = tie_problems("cpu")
    report["invariance"] = invariance_problems(torch.float32, "cpu", 19) + invariance_problems(
        torch.bfloat16, "cpu", 19
    )
    return report


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernel
test_kernel_ran_interpreted = checks.test_kernel_ran_interpreted  # the report's shared tests
test_interpreter_conformance = checks.test_interpreter_conformance


@slow
def test_interpreter_launches(report):
    assert not report["launches"], "\n".join(report["launches"])


@slow
def test_interpreter_numerics_bitwise(report):
    assert not report["numerics"], "\n".join(report["numerics"])


@slow
def test_interpreter_ties(report):
    assert not report["ties"], "\n".join(report["ties"])


@slow
def test_interpreter_batch_invariance(report):
    assert not report["invariance"], "\n".join(report["invariance"])


# ---------------------------------------------------------------------------------------------
# emulation, launch shapes and supports (no kernel runs)


def test_emulated_sums_follow_the_documented_orders():
    w = torch.tensor([[1.0, 2.0**-24, 2.0**-24, 2.0**-24, 2.0**-24, 2.0**-24]])
    # ((w0 + w4) + (w1 + w5)) + (w2 + w3) in fp32: w0 + w4 rounds to 1, then 1 + 2**-23 + 2**-23
    # (in slot order every 2**-24 would round away)
    assert _cuda_sum(w).item() == 1.0 + 2.0**-22
    e = torch.ones(1, 70)
    assert _softmax_sum(e).item() == 70.0


def test_block_rows_depend_on_the_expert_count_only():
    from deepinfer_cuda_sm100.kernels.routing import block_rows, last_pow2

    assert block_rows(256) == 4 and block_rows(384) == 2 and block_rows(1024) == 1
    assert block_rows(1) == 64 and block_rows(8) == 64
    assert [last_pow2(k) for k in (1, 2, 3, 5, 6, 8, 16)] == [1, 2, 2, 4, 4, 8, 16]


def test_kernel_and_ops_limits_agree():
    from deepinfer_cuda_sm100 import routing_ops
    from deepinfer_cuda_sm100.kernels import routing

    assert routing.MAX_EXPERTS == routing_ops.MAX_EXPERTS
    assert routing.MAX_TOP_K == routing_ops.MAX_TOP_K
    assert tuple(routing.SCORING) == routing_ops.SCORINGS


def _supports(interpreted: bool):
    from deepinfer_cuda_sm100.routing_ops import make_supports

    return make_supports(interpreted)


def _case(dtype=torch.bfloat16, t=3, e=16, k=4, scoring="sqrtsoftplus", hashed=False):
    g = torch.Generator().manual_seed(0)
    return _args(g, t, e, k, scoring, bias=not hashed, hashed=hashed, dtype=dtype)


def test_supports_takes_every_scoring_and_dtype():
    sup = _supports(True)
    for scoring in SCORINGS:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert sup(*_case(dtype, scoring=scoring)) is True, (scoring, dtype)
            assert sup(*_case(dtype, scoring=scoring, hashed=True)) is True, (scoring, dtype)
    args = _case()
    args[0] = torch.randn(3, 40)[:, 4:20].to(torch.bfloat16)  # a strided view
    assert sup(*args) is True
    args = _case(hashed=True)
    args[1] = torch.zeros(3)  # hash routing ignores the bias, as the reference
    args[3] = 99  # and top_k
    assert sup(*args) is True
    args = _case()
    args[1] = None  # no correction bias
    assert sup(*args) is True
    assert sup(*_case(e=1024, k=16)) is True


def test_supports_refuses_with_reasons():
    sup = _supports(True)

    def with_(index, value, **kw):
        args = _case(**kw)
        args[index] = value
        return sup(*args)

    assert "scoring" in with_(4, "relu")
    assert "logits must be" in with_(0, torch.randn(3, 16, dtype=torch.float64))
    assert "logits must be" in with_(0, torch.randn(3, 4, 16))
    assert "experts" in sup(*_case(e=1025, k=2))
    assert "top_k" in with_(3, 0)
    assert "top_k" in with_(3, 17, e=64)
    assert "top_k" in with_(3, 5, e=4)
    assert "top_k" in with_(3, 2.0)
    assert "correction_bias" in with_(1, torch.zeros(16, dtype=torch.bfloat16))
    assert "correction_bias" in with_(1, torch.zeros(15))
    assert "fixed_ids" in with_(2, torch.zeros(3, 4), hashed=True)
    assert "fixed_ids" in with_(2, torch.zeros(2, 4, dtype=torch.int64), hashed=True)
    assert "fixed_ids" in with_(2, torch.zeros(3, 17, dtype=torch.int64), hashed=True)
    assert "routed_scale" in with_(5, torch.tensor(1.5))
    assert "routed_scale" in with_(5, True)
    assert "tensor" in with_(0, [[1.0]])
    assert "GPU" in _supports(False)(*_case())  # CPU tensors for the compiled kernel


def test_supports_takes_the_batch_invariant_mode():
    from deepinfer_core.ops.modes import batch_invariant_mode

    with batch_invariant_mode():
        assert _supports(True)(*_case()) is True


# ---------------------------------------------------------------------------------------------
# compile for the GPU (no GPU needed)


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("arch", [90, 100])
def test_kernel_compiles_for_the_gpu(arch):
    from deepinfer_cuda_sm100.kernels import routing

    args = {"logits_ptr": "*bf16", "stride_lt": "i32", "stride_le": "i32", "bias_ptr": "*fp32"}
    args |= {"stride_b": "i32", "fixed_ptr": "*i64", "stride_ft": "i32", "stride_fk": "i32"}
    args |= {"w_ptr": "*bf16", "ids_ptr": "*i64", "n_rows": "i32", "routed_scale": "fp32"}
    variants = (("bf16", False), ("fp32", False), ("fp16", True))  # (dtype, hash routing)
    configs = [(scoring, dtype, hashed, 256, 6) for scoring in routing.SCORING for dtype, hashed in variants]
    configs += [
        ("softmax", "fp32", False, 384, 8),
        ("softmax", "bf16", False, 5, 2),
        ("sigmoid", "fp32", False, 1, 1),
    ]
    configs += [("sqrtsoftplus", "bf16", False, 1024, 16)]
    for scoring, dtype, hashed, e, k in configs:
        block_e = routing.pow2(e)
        consts = {"E": e, "K": k, "K_PAD": routing.pow2(k), "K_FOLD": routing.last_pow2(k)}
        consts |= {"SCORING_FN": routing.SCORING[scoring], "HAS_BIAS": not hashed, "HASH": hashed}
        consts |= {"BLOCK_T": routing.block_rows(e), "BLOCK_E": block_e, "LANES": min(block_e, 32)}
        typed = args | {"logits_ptr": f"*{dtype}", "w_ptr": f"*{dtype}"}
        compiled = compile_typed(
            routing._route_kernel, typed, consts, arch, hints=False, num_warps=4, enable_reflect_ftz=False
        )
        ptx, label = compiled.asm["ptx"], f"{scoring} {dtype} E={e} k={k}"
        assert "div.rn.f32" in ptx, f"{label}: no IEEE division"
        if scoring == "sqrtsoftplus":
            assert "sqrt.rn.f32" in ptx, f"{label}: no IEEE square root"
        assert "fma.rn.ftz" not in ptx, f"{label}: libdevice flushes denormals to zero"


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("hashed", [False, True], ids=["bias", "hash"])
def test_every_load_comes_before_the_scores_arithmetic(hashed):
    """The selection bias (or a hash layer's fixed picks) does not depend on the logits: the
    kernel loads it with them, so no global load waits behind the scores' divisions, square
    roots and block barriers (V4-Flash's sqrt-softplus routing over 64 experts, top-6)."""
    from deepinfer_cuda_sm100.kernels import routing

    args = {"logits_ptr": "*bf16", "stride_lt": "i32", "stride_le": "i32", "bias_ptr": "*fp32"}
    args |= {"stride_b": "i32", "fixed_ptr": "*i64", "stride_ft": "i32", "stride_fk": "i32"}
    args |= {"w_ptr": "*bf16", "ids_ptr": "*i64", "n_rows": "i32", "routed_scale": "fp32"}
    e, k = 64, 6
    consts = {"E": e, "K": k, "K_PAD": routing.pow2(k), "K_FOLD": routing.last_pow2(k)}
    consts |= {"SCORING_FN": routing.SCORING["sqrtsoftplus"], "HAS_BIAS": not hashed, "HASH": hashed}
    consts |= {"BLOCK_T": routing.block_rows(e), "BLOCK_E": e, "LANES": 32}
    ptx = compile_typed(
        routing._route_kernel, args, consts, 90, hints=False, num_warps=4, enable_reflect_ftz=False
    ).asm["ptx"]
    before, after = global_loads_around(ptx, "sqrt.rn", "div.rn", "bar.sync")
    assert before and after == 0, (before, after)


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_conformance(dtype):
    rows = _conformance("cuda", (dtype,))
    assert any(r["own"] and r["status"] == "passed" for r in rows)
    bad = failed_rows(rows)
    assert not bad, "\n".join(bad)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_launches_ties_and_invariance(dtype):
    problems = launch_problems(dtype, "cuda") + invariance_problems(dtype, "cuda", 200)
    if dtype == torch.float32:
        problems += tie_problems("cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 16, 200, 4096])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_gpu_v4_flash_shapes(tokens, scoring):
    g = torch.Generator().manual_seed(tokens)
    for dtype in (torch.bfloat16, torch.float32):
        for hashed in (False, True):
            args = _to(_args(g, tokens, 256, 6, scoring, bias=not hashed, hashed=hashed, dtype=dtype), "cuda")
            assert _impl().supports(*args) is True
            problems = _compare(f"{dtype} hash={hashed}", _impl().fn(*args), _reference(*args), dtype)
            assert not problems, "\n".join(problems)


@needs_cuda
@pytest.mark.parametrize("scoring", SCORINGS)
def test_gpu_bitwise_with_pytorch_cuda(scoring):
    """fp32 scores bit for bit against the reference on the GPU, and the chosen ids exactly:
    libdevice's expf / log1pf are what PyTorch's CUDA kernels call, divisions and square roots
    IEEE, no flush to zero, and the kernel follows PyTorch's warp-softmax order.  The claim rests
    on nvcc and Triton's LLVM contracting the same multiply-adds (e.g. expf's last product into
    sigmoid's ``1 + exp``).  The renormalised weights are held to the bound that any two
    summation orders of the k positive weights allow: (k - 1) ulps of the sum, plus the
    division's and the scaling's roundings.  PyTorch's CUDA ``sum`` order over k is not an
    interface (on torch 2.11 some rows of k = 6 differ from the order the kernel follows, by
    an ulp or two of the weight)."""
    from deepinfer_core.ops.moe import _SCORE_FNS

    g = torch.Generator().manual_seed(21)
    for e in (256, 384, 72):
        x = (torch.randn(512, e, generator=g) * 4).cuda()
        got, want = score_rows(x, scoring), _SCORE_FNS[scoring](x)
        diff = (got != want).sum().item()
        assert diff == 0, f"E={e}: {diff} scores differ from PyTorch's CUDA kernels"
        for k in (6, 8):
            args = _to(_args(g, 512, e, k, scoring), "cuda")
            (gw, gi), (ww, wi) = _impl().fn(*args), _reference(*args)
            assert torch.equal(gi, wi), f"E={e} k={k}: ids differ"
            ulp = torch.nextafter(ww.abs(), torch.full_like(ww, float("inf"))) - ww.abs()
            far = ((gw - ww).abs() > (k + 2) * ulp).sum().item()
            assert far == 0, f"E={e} k={k}: {far} weights more than {k + 2} ulps from PyTorch's"


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 256])
@pytest.mark.parametrize("hashed", [False, True])
def test_gpu_graph_capture(tokens, hashed):
    fn = _impl().fn
    g = torch.Generator().manual_seed(11)
    args = _to(
        _args(g, tokens, 256, 6, "sqrtsoftplus", bias=not hashed, hashed=hashed, dtype=torch.bfloat16), "cuda"
    )
    fn(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = fn(*args)
    for replay in range(2):  # new logits, bias and hash ids, in place
        fresh = _to(
            _args(g, tokens, 256, 6, "sqrtsoftplus", bias=not hashed, hashed=hashed, dtype=torch.bfloat16),
            "cuda",
        )
        for old, new in zip(args[:3], fresh[:3], strict=True):
            if old is not None:
                old.copy_(new)
        graph.replay()
        want_w, want_i = fn(*args)
        assert torch.equal(ids, want_i) and torch.equal(weights, want_w), (
            f"replay {replay}: differs from eager"
        )


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
