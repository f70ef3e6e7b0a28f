"""The work ``profile_step.py`` profiles: an engine whose requests all decode (a unit is one
decode step), or with ``--prefill`` an engine that prefills fresh prompts in one chunk (a unit
is one prefill of ``--batch`` prompts and their first tokens)."""

from __future__ import annotations

import argparse
import itertools
import random
from collections.abc import Callable

from deepinfer_core import LLM, SamplingParams


def engine_for(a: argparse.Namespace, eager: bool, **options: object) -> LLM:
    """The engine of the arguments' model, backend, weights' and KV cache's formats, ``--batch``
    requests at a time and ``options`` (``max_model_len``, ...); ``eager``: no device graphs."""
    keep = {"auto": None, "on": True, "off": False}[a.keep_quantized]
    return LLM(
        model=a.model,
        backend=a.backend,
        max_num_seqs=a.batch,
        keep_quantized=keep,
        kv_cache_dtype=a.kv_cache_dtype,
        enforce_eager=eager,
        **options,
    )


def decoding_engine(a: argparse.Namespace, eager: bool = False) -> tuple[LLM, int]:
    """An engine whose ``--batch`` requests all decode (their prompts prefilled); the steps left.
    ``eager``: built with ``enforce_eager=True`` (no device graphs)."""
    budget = a.warmup + a.steps * (3 if a.host and not eager else 1) + 4
    llm = engine_for(a, eager, max_model_len=a.prompt_len + budget + 8)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
    for i in range(a.batch):
        engine.add_request(f"p{i}", [rng.randrange(4, vocab) for _ in range(a.prompt_len)], params)
    running = engine.scheduler.running
    for _ in range(a.batch * a.prompt_len + 16):  # prefill chunks, at most one token each
        if len(running) == a.batch and all(r.output_token_ids for r in running):
            break
        engine.step()
    for _ in range(a.warmup):
        engine.step()
    return llm, budget - a.warmup


def prefill_engine(a: argparse.Namespace, eager: bool = False) -> tuple[LLM, Callable[[], None]]:
    """An engine that prefills ``--batch`` prompts of ``--prefill`` tokens in one chunk, and the
    unit of work to profile: admit that many prompts (prefix caching off: each is computed) and
    step until their first tokens are out (after ``--warmup`` such units).  ``eager`` as in
    :func:`decoding_engine`."""
    chunk = a.batch * a.prefill
    llm = engine_for(
        a, eager, max_num_batched_tokens=chunk, max_model_len=a.prefill + 8, enable_prefix_caching=False
    )
    engine = llm.engine
    rng = random.Random(0)
    prompt = [rng.randrange(4, engine.model_config.vocab_size) for _ in range(a.prefill)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = itertools.count()

    def prefill() -> None:
        for _ in range(a.batch):
            engine.add_request(f"p{next(ids)}", prompt, params)
        while engine.has_unfinished():
            engine.step()

    for _ in range(a.warmup):
        prefill()
    return llm, prefill


def workload(a: argparse.Namespace, eager: bool = False) -> tuple[LLM, Callable[[], object], int]:
    """The engine, the unit to profile (a decode step, or with ``--prefill`` a prefill of fresh
    prompts) and how many units it has left."""
    if a.prefill:
        llm, prefill = prefill_engine(a, eager)
        return llm, prefill, 3 * a.steps + 1
    llm, left = decoding_engine(a, eager)
    return llm, llm.engine.step, left
