"""Greedy sampling goes through the op table's ``argmax_rows``, so a backend's kernel picks the
greedy tokens.

* :class:`Sampler` calls its table's op for greedy rows (all greedy, greedy among sampled rows,
  and ``distribution``'s one-hot rows), never for rows that draw; ``Sampler()`` takes the
  reference table, whose op is ``torch.argmax`` bit for bit;
* a real engine on the built-in tiny model, on a test backend whose ``argmax_rows`` records its
  calls and runs the reference: the engine's sampler calls it for every greedy decode step with
  the step's ``[B, vocab]`` logits, the tokens equal a reference engine's, and a backend whose op
  answers a fixed token gets that token: the op's answer is what the engine emits; a backend
  that compiles its kernels at their first call gets the op warmed up at engine build.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.backends import BackendSpec
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.ops import OpImpl, OpTable
from deepinfer_core.ops.sampling import argmax_rows
from deepinfer_core.sampling.batch import SamplingBatch
from deepinfer_core.sampling.sampler import Sampler
from deepinfer_core.testing.managers import manager_with_plugin


class Recorder:
    """An ``argmax_rows`` that records each call's shape and caller, then answers ``fn``'s."""

    def __init__(self, fn=argmax_rows):
        self.fn = fn
        self.calls: list[tuple[tuple[int, ...], str]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((tuple(x.shape), sys._getframe(1).f_code.co_name))
        return self.fn(x)

    @property
    def callers(self) -> set[str]:
        return {caller for _, caller in self.calls}


def _batch(temperatures: list[float]) -> SamplingBatch:
    n = len(temperatures)
    return SamplingBatch(
        temperatures=temperatures, top_ps=[1.0] * n, top_ks=[0] * n, seeds=list(range(n)), positions=[0] * n
    )


def _logits(rows: int = 6, vocab: int = 300) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    x[1, [40, 7]] = 50.0  # a tie: the lowest id
    x[2, [9, 3]] = float("nan")  # NaN: the first one, as torch.argmax
    return x


def test_default_sampler_takes_the_reference_table():
    sampler = Sampler()
    assert sampler.ops.backend == "reference" and sampler.ops.argmax_rows is argmax_rows
    x = _logits()
    assert torch.equal(sampler(x, _batch([0.0] * 6)).token_ids, torch.argmax(x, dim=-1))


@pytest.mark.parametrize(
    ("temperatures", "rows"),
    [([0.0] * 6, 6), ([0.0, 0.8, 0.0, 0.0, 1.0, 0.0], 6), ([0.9] * 6, None)],
    ids=["all-greedy", "mixed", "all-sampled"],
)
def test_sampler_picks_greedy_rows_with_its_tables_op(temperatures, rows):
    rec = Recorder()
    x = _logits()
    got = Sampler(OpTable({"argmax_rows": OpImpl(rec)}, backend="test"))(x, _batch(temperatures))
    want = Sampler()(x, _batch(temperatures))
    assert torch.equal(got.token_ids, want.token_ids)  # bitwise the reference sampler's
    assert rec.calls == ([] if rows is None else [((rows, 300), "sample")])


def test_distribution_one_hot_rows_come_from_the_op():
    rec = Recorder(lambda x: torch.full((x.shape[0],), 5, dtype=torch.int64))
    sampler = Sampler(OpTable({"argmax_rows": OpImpl(rec)}, backend="test"))
    x = _logits()
    probs = sampler.distribution(x, _batch([0.0, 0.7, 0.0, 0.0, 0.0, 0.0]).prepare("cpu", 300))
    assert rec.calls == [((6, 300), "distribution")]
    assert torch.equal(probs[[0, 2, 3, 4, 5]].argmax(dim=-1), torch.full((5,), 5))
    assert probs[1].sum().item() == pytest.approx(1.0) and probs[1].count_nonzero() > 1  # drawn row
    ref = Sampler().distribution(x, _batch([0.0] * 6).prepare("cpu", 300))
    assert torch.equal(ref.argmax(dim=-1), torch.argmax(x, dim=-1))


# ---------------------------------------------------------------------------------------------
# a real engine on a backend that overrides argmax_rows


def _engine(tiny_dir: Path, op, compiles: bool = False, **config) -> LLMEngine:
    spec = BackendSpec(
        name="greedy_test", device_type="cpu", priority=5, ops={"argmax_rows": op}, compiles_kernels=compiles
    )

    class Plugin:
        @hookimpl
        def deepinfer_register_backends(self, register):
            register(spec)

    manager = manager_with_plugin(Plugin(), "greedy_test")
    return LLMEngine(EngineConfig(model=str(tiny_dir), backend="greedy_test", **config), plugins=manager)


def _generate(engine: LLMEngine, params: SamplingParams, n: int = 3) -> list[list[int]]:
    for i in range(n):
        engine.add_request(f"r{i}", list(range(5 + i, 17 + 2 * i)), params)
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    return [list(r.outputs[0].token_ids) for r in sorted(finished, key=lambda r: r.request_id)]


GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def test_engine_greedy_decoding_calls_the_backends_op(tiny_dir: Path):
    rec = Recorder()
    engine = _engine(tiny_dir, rec, max_num_seqs=4)
    assert engine.ops.sources["argmax_rows"] == "backend" and engine.sampler.ops is engine.ops
    tokens = _generate(engine, GREEDY)
    reference = _generate(
        LLMEngine(EngineConfig(model=str(tiny_dir), backend="reference", max_num_seqs=4)), GREEDY
    )
    assert tokens == reference
    vocab = engine.model_config.vocab_size
    assert rec.callers == {"sample"}
    assert all(shape[1] == vocab for shape, _ in rec.calls)
    assert sum(shape[0] for shape, _ in rec.calls) >= 3 * 5  # every emitted token
    assert (3, vocab) in {shape for shape, _ in rec.calls}  # a decode step of the three requests


def test_engine_emits_what_the_op_answers(tiny_dir: Path):
    fixed = Recorder(lambda x: torch.full((x.shape[0],), 11, dtype=torch.int64, device=x.device))
    assert _generate(_engine(tiny_dir, fixed), GREEDY) == [[11] * 5] * 3


def test_engine_sampled_requests_do_not_call_it(tiny_dir: Path):
    rec = Recorder()
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True)
    tokens = _generate(_engine(tiny_dir, rec), sampled)
    reference = _generate(LLMEngine(EngineConfig(model=str(tiny_dir), backend="reference")), sampled)
    assert tokens == reference and rec.calls == []


def test_a_compiling_backends_op_is_warmed_up_before_any_request(tiny_dir: Path):
    """A backend that compiles its kernels at their first call gets ``argmax_rows`` called at
    engine build (one row and a full decode batch of fp32 logits), so no request pays it."""
    rec = Recorder()
    engine = _engine(tiny_dir, rec, compiles=True, max_num_seqs=4)
    vocab = engine.model_config.vocab_size
    assert rec.calls == [((1, vocab), "_warm_up"), ((4, vocab), "_warm_up")]
    rec.calls.clear()
    reference = LLMEngine(EngineConfig(model=str(tiny_dir), backend="reference", max_num_seqs=4))
    assert _generate(engine, GREEDY) == _generate(reference, GREEDY) and rec.callers == {"sample"}
