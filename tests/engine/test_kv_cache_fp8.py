"""``kv_cache_dtype="fp8"`` end to end on the built-in tiny model: the window ring and the
compressed entries are packed FP8 pools, the cache holds more tokens in the same memory, the
results are those of a plain cache whose attention reads quantised keys (bitwise) and stay
close to the unquantised run, and prefix caching, preemption and host-sync-free steps still
hold."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.cache_spec import PagedSpec, RingSpec, spec_bytes
from deepinfer_core.models.deepseek_v4.config import CSA, HCA
from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir
from deepinfer_core.ops.kv_format import Fp8KVPool, dequantize_fp8_rows, fp8_row_bytes, quantize_fp8_rows
from tests.engine.test_preemption_property import _run
from tests.ops.sync_check import record_host_syncs

# the float32 cases run in the fast tier, the bfloat16 ones are marked slow
DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)]


def _llm(**kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 16)  # prompts span several chunks: the ring is read
    return LLM(backend="reference", max_num_seqs=8, **kw)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(2, 300, (n,), generator=g).tolist()} for n in lengths]


def test_option_is_validated_and_reaches_the_cli():
    from deepinfer_core.cli import build_parser
    from deepinfer_core.cli_engine_args import engine_kwargs

    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig.load(env={"DEEPINFER_KV_CACHE_DTYPE": "fp8"}).kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp16'"):
        EngineConfig(kv_cache_dtype="fp16")
    args = build_parser().parse_args(["generate", "--prompt", "x", "--kv-cache-dtype", "fp8"])
    assert engine_kwargs(args) == {"kv_cache_dtype": "fp8"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_window_and_compressed_entries_are_packed_and_the_cache_holds_more_tokens(dtype):
    plain = _llm(dtype=dtype, kv_cache_memory_gb=0.002)
    fp8 = _llm(dtype=dtype, kv_cache_memory_gb=0.002, kv_cache_dtype="fp8")
    assert fp8.kv_cache_capacity_tokens > plain.kv_cache_capacity_tokens
    runner, cfg = fp8.engine.runner, fp8.engine.runner.model_config
    row = fp8_row_bytes(cfg.head_dim, cfg.rope_dim)
    assert row == 48 < cfg.head_dim * 2  # a bfloat16 row takes 64 bytes, a float32 one 128
    specs = runner.model.cache_specs("fp8")
    for layer, layer_specs in enumerate(specs):
        kinds = {s.name: s for s in layer_specs}
        assert isinstance(runner.cache.get(layer, "window"), Fp8KVPool)
        assert kinds["window"].kv_format == "fp8" and kinds["window"].rope_dim == cfg.rope_dim
        if cfg.layer_types[layer] in (CSA, HCA):
            ckv = runner.cache.get(layer, "ckv")
            assert isinstance(ckv, Fp8KVPool) and ckv.data.shape[1] == row
            spec = kinds["ckv"]
            assert isinstance(spec, PagedSpec)
            assert spec_bytes(spec, runner.page_size, runner.dtype) == (
                runner.page_size // spec.ratio * row,
                0,
            )
        if cfg.layer_types[layer] == CSA:  # indexer keys and compressor state keep the model dtype
            assert runner.cache.get(layer, "ikv").dtype == runner.dtype
            assert runner.cache.get(layer, "ckv.buf_kv").dtype == runner.dtype
    ring = next(s for s in specs[0] if isinstance(s, RingSpec))
    assert spec_bytes(ring, runner.page_size, runner.dtype) == (0, ring.width * row)
    # the packed pools are counted in the cache's bytes
    assert runner.cache.nbytes < plain.engine.runner.cache.nbytes * 4


def _fake_quant_attention(llm: LLM, rope_dim: int) -> None:
    """Make ``llm`` (a plain cache) attend to its keys as the FP8 format stores them."""
    ops = llm.engine.runner.ops
    inner = ops.sparse_attention

    def attention(q, pools, indices, sinks, scale):
        quantised = [
            dequantize_fp8_rows(quantize_fp8_rows(p, rope_dim), p.shape[-1], rope_dim, q.dtype) for p in pools
        ]
        return inner(q, quantised, indices, sinks, scale)

    ops.sparse_attention = attention


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_cache_equals_a_plain_cache_read_through_the_fp8_format(dtype):
    """Storage, row addressing (ring and pages) and the chunk's own keys: the FP8 engine gives
    bitwise the tokens and logprobs of a plain-cache engine whose attention quantises and
    dequantises every key it reads."""
    prompts = _prompts(0, (3, 11, 40, 70))
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    got = _llm(dtype=dtype, kv_cache_dtype="fp8").generate(prompts, params, use_tqdm=False)
    ref = _llm(dtype=dtype)
    _fake_quant_attention(ref, ref.engine.runner.model_config.rope_dim)
    want = ref.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_cache_stays_close_to_the_model_dtype_cache(dtype):
    """Teacher-forced greedy tokens (the argmax at every prompt position) mostly agree, and the
    last-token logprobs differ by a bounded amount (FP8 noise, not garbage)."""
    prompts = _prompts(1, (9, 17, 40, 70, 100))
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5, prompt_logprobs=5)
    fp8 = _llm(dtype=dtype, kv_cache_dtype="fp8").generate(prompts, params, use_tqdm=False)
    plain = _llm(dtype=dtype).generate(prompts, params, use_tqdm=False)
    same = total = 0
    last_err = []
    for a, b in zip(fp8, plain, strict=True):
        steps = list(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True))
        steps.append((a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]))
        for la, lb in steps:
            same += max(la, key=la.get) == max(lb, key=lb.get)
            total += 1
        la, lb = steps[-1]
        last_err.append(max(abs(la[k] - lb[k]) for k in la.keys() & lb.keys()))
    assert same >= 0.75 * total, (same, total)  # ~87% on the tiny model, in both dtypes
    assert 0 < max(last_err) < 1.0, last_err
    assert sorted(last_err)[len(last_err) // 2] < 0.3, last_err


@pytest.mark.slow  # the dispatch-mode recorder makes each op slow
def test_forward_steps_make_no_host_sync():
    llm = _llm(kv_cache_dtype="fp8")
    runner = llm.engine.runner
    inner, found = runner.forward, []

    def forward(inputs):
        with record_host_syncs() as syncs:
            out = inner(inputs)
        found.extend(syncs)
        return out

    runner.forward = forward
    llm.generate(_prompts(2, (35, 3)), SamplingParams(max_tokens=6), use_tqdm=False)
    assert not found, sorted(set(found))


@pytest.mark.slow
def test_prefix_hit_equals_cold_run_bitwise_in_batch_invariant_mode():
    first, second = _prompts(3, (131, 131))
    second["prompt_token_ids"][:128] = first["prompt_token_ids"][:128]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    kw = {"kv_cache_dtype": "fp8", "batch_invariant": True, "page_size": 16}
    want = _llm(enable_prefix_caching=False, **kw).generate([second], params, use_tqdm=False)[0]
    warm = _llm(**kw)
    warm.generate([first], params, use_tqdm=False)
    got = warm.generate([second], params, use_tqdm=False)[0]
    assert warm.get_metrics()["num_prefix_hit_tokens"] == 128
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].logprobs == want.outputs[0].logprobs


@pytest.mark.slow
def test_preempted_requests_resume_through_replay_and_match():
    def engine(num_pages: int, budget: int) -> LLMEngine:
        cfg = EngineConfig(
            model=str(builtin_tiny_model_dir()),
            backend="reference",
            dtype="float32",
            max_num_seqs=4,
            max_num_batched_tokens=budget,
            page_size=16,
            num_cache_pages=num_pages,
            max_model_len=112,
            kv_cache_dtype="fp8",
            batch_invariant=True,
        )
        return LLMEngine(cfg)

    prompts = [
        torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (60, 55)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _run(engine(64, 256), {f"r{i}": (p, params) for i, p in enumerate(prompts)}, {}, 10_000)
    small = engine(num_pages=7, budget=32)  # 112 positions for two requests of ~90: must preempt
    got = _run(small, {f"r{i}": (p, params) for i, p in enumerate(prompts)}, {}, 10_000)
    assert small.metrics.num_preemptions > 0
    for rid in got:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
    kv = small.runner.kv_cache
    assert kv.num_free_pages == kv.num_pages and kv.num_free_slots == kv.num_slots


@pytest.mark.gpu
def test_cuda_sm100_reads_the_fp8_cache_in_its_kernel_and_gives_the_references_tokens(caplog):
    """On the GPU, ``cuda_sm100`` with ``kv_cache_dtype="fp8"`` runs its attention kernel on the
    packed pools (no fallback logged for ``sparse_attention``), CUDA graphs on, and gives the
    greedy tokens of the reference on the CPU with the same cache format (fp32 tiny model)."""
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
    prompts = _prompts(3, (5, 40, 90, 17))
    with caplog.at_level("INFO", logger="deepinfer"):
        gpu = LLM(backend="cuda_sm100", device="cuda", dtype="float32", max_num_seqs=8, kv_cache_dtype="fp8")
        got = [o.outputs[0] for o in gpu.generate(prompts, params, use_tqdm=False)]
    assert gpu.engine.runner.graph_manager.graphs("decode"), "CUDA graphs were not captured"
    assert not [
        r for r in caplog.records if "sparse_attention" in r.getMessage() and "rejects" in r.getMessage()
    ]
    want = [
        o.outputs[0]
        for o in _llm(dtype="float32", kv_cache_dtype="fp8").generate(prompts, params, use_tqdm=False)
    ]
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for token, g_top, w_top in zip(w.token_ids, g.logprobs, w.logprobs, strict=True):
            assert abs(g_top[token] - w_top[token]) < 2e-2
