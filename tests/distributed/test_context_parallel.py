"""Balanced context parallelism: the zig-zag split, and CP ranks of the tiny model (gloo on CPU)
against a single-process runner (the oracle) on the same steps."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.context_parallel import (
    CP_MIN_TOKENS,
    CP_MIN_TOKENS_ENV,
    balanced_pieces,
    contiguous_pieces,
    cp_min_tokens,
    piece_bounds,
    plan_step,
    rank_costs,
)
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.kv_format import Fp8KVPool
from deepinfer_core.testing.observe import counting_context_parallel_forwards
from tests.distributed.outputs import assert_same_completions

CP_MIN = 64  # the tests' threshold: prompts of 100-300 tokens are split, short chunks are not


# ---- the split (pure) ----------------------------------------------------------------------
@pytest.mark.parametrize("cp_size", [2, 3, 4, 8])
@pytest.mark.parametrize("num_tokens", [16, 97, 1000, 4099])
def test_zigzag_pieces_cover_the_chunk_and_balance_rows(num_tokens: int, cp_size: int) -> None:
    pieces = balanced_pieces(num_tokens, cp_size)
    rows = torch.cat(pieces)
    assert torch.equal(rows.sort().values, torch.arange(num_tokens))  # a partition
    counts = [len(p) for p in pieces]
    assert max(counts) - min(counts) <= 1
    b = piece_bounds(num_tokens, cp_size)
    assert len(b) == 2 * cp_size + 1 and b[0] == 0 and b[-1] == num_tokens
    for i, p in enumerate(pieces):  # rank i: pieces i and 2C-1-i, each contiguous
        j = 2 * cp_size - 1 - i
        assert p.tolist() == list(range(b[i], b[i + 1])) + list(range(b[j], b[j + 1]))


@pytest.mark.parametrize("cp_size", [2, 4, 8])
@pytest.mark.parametrize("start", [0, 5000])
def test_zigzag_balances_causal_work_and_a_contiguous_split_does_not(cp_size: int, start: int) -> None:
    n = 32768
    zig = rank_costs(balanced_pieces(n, cp_size), start)
    flat = rank_costs(contiguous_pieces(n, cp_size), start)
    assert sum(zig) == sum(flat) == sum(range(start + 1, start + n + 1))
    assert max(zig) / min(zig) < 1.001
    # contiguous: the last rank's queries see the most keys
    assert max(flat) / min(flat) > (1.3 if start else 2.5)


def test_step_plan_keeps_short_chunks_on_every_rank_and_gathers_in_natural_order() -> None:
    lengths, split = [1, 150, 30, 7], [False, True, False, False]
    samples = torch.tensor([0, 150, 151 + 29])
    plans = [plan_step(lengths, split, samples, 4, r, None, torch.device("cpu")) for r in range(4)]
    t = sum(lengths)
    shared = set(range(1)) | set(range(151, t))
    stacked = torch.full((4 * plans[0].num_local,), -1)
    for r, p in enumerate(plans):
        local = p.local_rows.tolist()
        assert len(local) == p.num_local and p.split == [(1, 150)]
        assert shared <= set(local)  # short chunks and decodes: every rank
        own = {1 + x for x in balanced_pieces(150, 4)[r].tolist()}
        assert own <= set(local)
        stacked[r * p.num_local : (r + 1) * p.num_local] = p.local_rows
    for p in plans:  # gathering each rank's local rows gives every row, in natural order
        assert torch.equal(stacked.index_select(0, p.gather_index), torch.arange(t))
        assert torch.equal(p.sample_index, p.gather_index[samples])
    assert all(int(plans[0].gather_index[j]) < plans[0].num_local for j in shared)  # from rank 0


def test_cp_min_tokens_default_and_environment_override() -> None:
    assert cp_min_tokens({}) == CP_MIN_TOKENS
    assert cp_min_tokens({CP_MIN_TOKENS_ENV: " 64 "}) == 64
    for bad in ("lots", "0"):
        with pytest.raises(ValueError, match=CP_MIN_TOKENS_ENV):
            cp_min_tokens({CP_MIN_TOKENS_ENV: bad})


# ---- the model: CP ranks vs one process ----------------------------------------------------
def _runner(
    model_dir: Path,
    batch_invariant: bool,
    parallel: ParallelState | None = None,
    kv_cache_dtype: str = "auto",
) -> ModelRunner:
    cfg = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        max_num_seqs=4,
        batch_invariant=batch_invariant,
        kv_cache_dtype=kv_cache_dtype,
    )
    runner = ModelRunner.load(model_dir, cfg, OpTable.reference(), parallel=parallel)
    runner.model.cp_min_tokens = CP_MIN
    return runner


def _cache_state(runner: ModelRunner) -> dict[str, torch.Tensor]:
    out = {}
    for layer, specs in enumerate(runner.model.cache_specs()):
        for spec in specs:
            t = runner.cache.get(layer, spec.name)
            out[f"{layer}.{spec.name}"] = (t.data if isinstance(t, Fp8KVPool) else t).clone()
    return out


def _script(runner: ModelRunner) -> dict[str, Any]:
    """The steps every process runs: B's short prefill; A's prompt in two CP chunks sharing
    steps with B's decodes and D's short prefill; decodes of all three; C, a prefix-cache hit
    on A's first 128 tokens (replayed from the window tail, then a CP chunk); C's decode.
    Decode tokens are fixed (not sampled), so the steps do not depend on the logits."""
    g = torch.Generator().manual_seed(0)
    prompt = {
        k: torch.randint(4, 500, (n,), generator=g).tolist() for k, n in (("A", 280), ("B", 20), ("D", 30))
    }
    kv = runner.kv_cache
    table = {k: kv.allocate_pages(kv.pages_needed(len(p) + 8)) for k, p in prompt.items()}
    slot = {"A": 0, "B": 1, "D": 2, "C": 3}
    pos = {k: 0 for k in prompt}
    logits: list[torch.Tensor] = []

    def chunk(k: str, n: int, all_logits: bool = False) -> SeqChunk:
        c = SeqChunk(slot[k], prompt[k][pos[k] : pos[k] + n], pos[k], table[k], all_logits=all_logits)
        pos[k] += n
        return c

    def decode(k: str) -> SeqChunk:
        prompt[k].append(int(torch.randint(4, 500, (1,), generator=g)))
        return chunk(k, 1)

    def step(chunks: list[SeqChunk]) -> None:
        logits.append(runner.execute(chunks).clone())

    step([chunk("B", 20)])
    step([decode("B"), chunk("A", 150, all_logits=True), chunk("D", 30)])
    step([chunk("A", 130, all_logits=True), decode("B"), decode("D")])
    after_prefill = _cache_state(runner)
    for _ in range(3):
        step([decode("A"), decode("B"), decode("D")])
    # C: A's first 128 tokens cached (8 pages), its window rebuilt by replaying the tail
    cached = 128
    c_prompt = prompt["A"][:cached] + torch.randint(4, 500, (90,), generator=g).tolist()
    start = cached - runner.replay_tail
    c_table = table["A"][: cached // runner.page_size] + kv.allocate_pages(6)
    c = SeqChunk(
        slot["C"], c_prompt[start:], start, c_table, all_logits=True, window_from=start, cached_until=cached
    )
    step([c, decode("B")])
    step([SeqChunk(slot["C"], [7], len(c_prompt), c_table), decode("A")])
    return {"logits": logits, "after_prefill": after_prefill, "end": _cache_state(runner)}


def _cp_worker(rank: int, dp: int, cp: int, init: str, model_dir: str, out: str, bi: bool, kv: str) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=dp * cp, timeout=timeout)
    try:
        layout = ParallelState.layout(rank, dp, cp, False)
        group = None
        for replica in range(dp):  # every rank creates every group, in the same order
            g = dist.new_group(ranks=list(range(replica * cp, (replica + 1) * cp)))
            if replica == layout["dp_rank"]:
                group = g
        parallel = ParallelState(**layout, device_group=dist.group.WORLD, cp_group=group)
        runner = _runner(Path(model_dir), bi, parallel, kv)
        splits: list[tuple[int, int, list]] = []
        forward = runner.model.forward

        def observed(md, cache, hidden_out=None):  # records which steps split rows
            if md.cp is not None:
                splits.append((md.input_ids.shape[0], md.cp.num_local, md.cp.split))
            return forward(md, cache, hidden_out)

        runner.model.forward = observed
        result = _script(runner)
        result["splits"] = splits
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


_ORACLE: dict[tuple[bool, str], dict[str, Any]] = {}


def _oracle(model_dir: Path, bi: bool, kv: str) -> dict[str, Any]:
    if (bi, kv) not in _ORACLE:
        _ORACLE[bi, kv] = _script(_runner(model_dir, bi, kv_cache_dtype=kv))
    return _ORACLE[bi, kv]


def _equal(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    if exact:
        return torch.equal(a, b)
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("dp", "cp", "bi", "kv"),
    [
        (1, 2, True, "auto"),
        pytest.param(1, 2, False, "auto", marks=pytest.mark.slow),
        pytest.param(1, 4, True, "auto", marks=pytest.mark.slow),
        pytest.param(1, 2, True, "fp8", marks=pytest.mark.slow),
        pytest.param(2, 2, True, "auto", marks=pytest.mark.slow),
        pytest.param(1, 4, False, "auto", marks=pytest.mark.slow),
    ],
)
def test_cp_ranks_match_one_process(
    dp: int, cp: int, bi: bool, kv: str, tiny_dir: Path, tmp_path: Path
) -> None:
    """Every rank of every CP group returns the single process's logits in every step (bitwise
    with ``batch_invariant``, else within 1e-5) and holds its cache -- window rings, compressed
    entries (packed FP8 with ``kv_cache_dtype="fp8"``), indexer keys, compressor buffers and
    carries, page snapshots -- after the two CP prefill chunks and at the end (after decodes and
    a prefix-cache hit); the ranks of a group agree with each other bitwise in both modes
    (mirrors)."""
    args = (dp, cp, f"file://{tmp_path}/store", str(tiny_dir), str(tmp_path), bi, kv)
    mp.spawn(_cp_worker, args=args, nprocs=dp * cp, join=True)
    ref = _oracle(tiny_dir, bi, kv)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(dp * cp)]
    for r, res in enumerate(results):
        # the CP chunks were split (A's two chunks, C's chunk), the rest was not
        assert [s[2] for s in res["splits"]] == [[(1, 150)], [(0, 130)], [(0, 138)]], f"rank {r}"
        for t, local, _ in res["splits"]:
            assert local < t, f"rank {r}: {local} local rows of {t}"
        assert len(res["logits"]) == len(ref["logits"])
        for i, (ours, want) in enumerate(zip(res["logits"], ref["logits"], strict=True)):
            assert _equal(ours, want, bi), f"rank {r} step {i}: max diff {(ours - want).abs().max()}"
        for when in ("after_prefill", "end"):
            for name, want in ref[when].items():
                got = res[when][name]
                assert _equal(got, want, bi), (
                    f"rank {r} {when} cache {name}: max diff {(got - want).abs().max()}"
                )
    for group in range(dp):
        lead = results[group * cp]
        for r in range(group * cp + 1, (group + 1) * cp):
            for i, (a, b) in enumerate(zip(results[r]["logits"], lead["logits"], strict=True)):
                assert torch.equal(a, b), f"rank {r} step {i}: logits differ from its group's rank 0"
            for when in ("after_prefill", "end"):
                for name, t in lead[when].items():
                    assert torch.equal(results[r][when][name], t), f"rank {r} {when} cache {name}"


# ---- the engine: LLM(context_parallel_size=...) vs one process -----------------------------
_SHARED = [(5 * j) % 300 + 4 for j in range(96)]  # a prefix two prompts share (prefix-cache hits)
ENGINE_PROMPTS = [
    {"prompt_token_ids": [(7 * i + 3 * j) % 200 + 2 for j in range(40 + 60 * i)]} for i in range(4)
]
ENGINE_PROMPTS += [
    {"prompt_token_ids": _SHARED + [(11 * j + i) % 90 + 2 for j in range(50)]} for i in range(2)
]
ENGINE_PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)


def _generate(
    model_dir: Path, bi: bool, min_tokens: int | None = None, **options: Any
) -> tuple[list[Any], int]:
    """Greedy outputs of ``ENGINE_PROMPTS``, and how many steps rank 0 split over its CP group
    (``min_tokens``: the ``context_parallel_min_tokens`` option; ``None`` = the environment's)."""
    if min_tokens is not None:
        options["context_parallel_min_tokens"] = min_tokens
    with LLM(
        model=str(model_dir),
        backend="reference",
        dtype="float32",
        batch_invariant=bi,
        max_num_batched_tokens=128,  # chunked prefill: prompts of up to 220 tokens in CP chunks
        **options,
    ) as llm:
        model = llm.engine.runner.model
        assert model.cp_min_tokens == (CP_MIN if min_tokens is None else min_tokens)
        with counting_context_parallel_forwards(model) as split:
            outs = llm.generate(ENGINE_PROMPTS, ENGINE_PARAMS, use_tqdm=False)
        return [o.outputs[0] for o in outs], split[0]


@pytest.mark.parametrize(
    ("dp", "cp", "bi", "ep"),
    [
        pytest.param(1, 2, True, False, marks=pytest.mark.slow),
        pytest.param(1, 2, False, False, marks=pytest.mark.slow),
        pytest.param(2, 2, True, False, marks=pytest.mark.slow),
        pytest.param(2, 2, True, True, marks=pytest.mark.slow),
    ],
)
def test_llm_with_context_parallelism_matches_one_process(
    dp: int, cp: int, bi: bool, ep: bool, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LLM(context_parallel_size=C[, data_parallel_size=2][, enable_expert_parallel=True])``:
    greedy tokens and top logprobs equal one process's (bitwise with ``batch_invariant``, within
    1e-5 otherwise), and rank 0 did split prefill chunks over its group (with expert
    parallelism its MoE dispatches only its local rows)."""
    monkeypatch.setenv(CP_MIN_TOKENS_ENV, str(CP_MIN))  # the workers inherit it
    want, none = _generate(tiny_dir, bi)
    assert none == 0
    options = {"data_parallel_size": dp, "context_parallel_size": cp, "enable_expert_parallel": ep}
    got, split = _generate(tiny_dir, bi, **options)
    assert split > 0
    assert_same_completions(got, want, exact=bi)


@pytest.mark.slow
def test_context_parallel_min_tokens_option(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``EngineConfig.context_parallel_min_tokens`` sets every rank's ``model.cp_min_tokens``
    over the environment's: at ``CP_MIN`` rank 0 splits chunks and the greedy outputs equal one
    process's bitwise (``batch_invariant``); at 10**6 (the environment saying ``CP_MIN``) none
    is split."""
    monkeypatch.delenv(CP_MIN_TOKENS_ENV, raising=False)
    want, _ = _generate(tiny_dir, True, min_tokens=CP_MIN)
    got, split = _generate(tiny_dir, True, min_tokens=CP_MIN, context_parallel_size=2)
    assert split > 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g.token_ids, g.logprobs) == (w.token_ids, w.logprobs), f"prompt {i}"
    monkeypatch.setenv(CP_MIN_TOKENS_ENV, str(CP_MIN))  # the workers inherit it; the option wins
    got, split = _generate(tiny_dir, True, min_tokens=10**6, context_parallel_size=2)
    assert split == 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_v41_refuses_context_parallelism(tiny_dir: Path) -> None:
    """DeepSeek-V4.1's family refuses ``context_parallel_size > 1`` with one line, in the
    loader and in ``build_model``, as it refuses expert parallelism."""
    from deepinfer_core.models.deepseek_v41.family import build_model, load_weights

    cp2 = ParallelState(rank=1, world_size=2, cp_rank=1, cp_size=2)
    message = r"'deepseek_v41': context_parallel_size=2 is not implemented yet"
    with pytest.raises(ConfigError, match=message) as err:
        load_weights(tiny_dir, None, torch.float32, torch.device("cpu"), (), parallel=cp2)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=message):
        build_model(None, {}, None, parallel=cp2)  # type: ignore[arg-type]
