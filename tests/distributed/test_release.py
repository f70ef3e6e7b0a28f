"""Releasing an ``LLM`` releases what it holds, as any Python resource holder does: ``del llm``
(its last reference gone, with the cyclic garbage collector off, so reference counting alone
does it) or the end of a ``with LLM(...)`` block ends a distributed run (the worker processes
exit 0 and this process leaves the ``torch.distributed`` world), so a second distributed ``LLM``
starts in the same process and generates what a single process does; a single-process ``LLM``
stops its grammar worker thread."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch.distributed as dist

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.sampling.params import StructuredOutputsParams

OPTIONS: dict[str, Any] = {"backend": "reference", "max_num_seqs": 4, "max_model_len": 128}
PROMPTS = [{"prompt_token_ids": [3 + k] * (2 + 3 * k)} for k in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Only reference counting frees objects inside the block."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _grammar_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("deepinfer-grammar")]


def test_del_frees_a_single_process_llm_without_the_cyclic_collector() -> None:
    with _no_cyclic_gc():
        llm = LLM(**OPTIONS)
        ref = weakref.ref(llm)
        del llm
        assert ref() is None


@pytest.mark.slow
def test_del_stops_the_grammar_worker_thread() -> None:
    params = SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    with _no_cyclic_gc():
        llm = LLM(**OPTIONS)
        outputs = llm.generate(["a", "b"], params, use_tqdm=False)
        assert {o.outputs[0].text for o in outputs} <= {"yes", "no"}
        assert _grammar_threads(), "a constrained request on the CPU fills its masks on a worker thread"
        del llm
        assert _grammar_threads() == []


@pytest.mark.slow
def test_del_and_with_release_a_distributed_run() -> None:
    want = _tokens(LLM(**OPTIONS).generate(PROMPTS, GREEDY, use_tqdm=False))  # one process
    with _no_cyclic_gc():
        llm = LLM(**OPTIONS, data_parallel_size=2)
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        procs = list(llm.client.procs.values())
        ref = weakref.ref(llm)
        del llm
        assert ref() is None
        assert [p.poll() for p in procs] == [0]  # the worker exited by itself, status 0
        assert not dist.is_initialized()
    with LLM(**OPTIONS, data_parallel_size=2) as llm:  # a second run in this process
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        procs = list(llm.client.procs.values())
    assert [p.poll() for p in procs] == [0]
    assert not dist.is_initialized()
    llm.shutdown()  # idempotent after the block
