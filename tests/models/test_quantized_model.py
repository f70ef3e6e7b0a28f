"""keep_quantized end to end: the tiny model written as a native FP8/FP4 checkpoint runs with its
weights held quantised and gives the dequantised model's tokens and (fp32) logits bitwise."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.backends import BackendSpec
from deepinfer_core.config import EngineConfig
from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.engine.graphs import EmulatedGraph
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.errors import PluginError
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.models.deepseek_v4 import tiny
from deepinfer_core.testing.managers import manager_with_plugin
from deepinfer_core.weights.quant import QuantizedTensor

PROMPTS = [
    "The lighthouse keeper woke before the gulls. He climbed the spiral stair, counted the steps "
    "as he always did, and wiped the salt from the great glass lens.",
    "Once upon a time",
    "A",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def fp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a native FP8 (128x128 blocks) / FP4 (groups of 32) checkpoint."""
    return tiny.make_tiny(
        tmp_path_factory.mktemp("fp8_fp4"), names="native", fp8_linear=True, fp4_experts=True
    )


@pytest.fixture(scope="module")
def small_block_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same with 32x32 FP8 blocks: the tiny model's 32-row projections then fuse quantised."""
    return tiny.make_tiny(
        tmp_path_factory.mktemp("fp8_32"),
        names="native",
        fp8_linear=True,
        fp4_experts=True,
        fp8_block=(32, 32),
    )


def _llm(model: Path | str, **kw) -> LLM:
    return LLM(model=str(model), backend="reference", max_num_seqs=4, **kw)


def _prompt_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    runner = llm.engine.runner
    kv = runner.kv_cache
    slot, pages = kv.allocate_slot(), kv.allocate_pages(kv.pages_needed(len(ids)))
    try:
        return runner.execute([SeqChunk(slot, ids, 0, pages, sample=True, all_logits=True)])
    finally:
        kv.free_pages(pages)
        kv.free_slot(slot)


def _completions(llm: LLM, params: SamplingParams = GREEDY) -> list:
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_quantised_weights_give_the_dequantised_model_bitwise(fp_dir: Path, dtype: str) -> None:
    """The reference dequantises each quantised weight per call to bitwise the tensor the loader
    would have held, and every fused projection with quantised parts of the tiny model is
    dequantised at load (its 32-row parts are not multiples of 128): same ops, same bits."""
    plain, kept = (
        _llm(fp_dir, dtype=dtype, keep_quantized=False),
        _llm(fp_dir, dtype=dtype, keep_quantized=True),
    )
    assert (plain.config.keep_quantized, kept.config.keep_quantized) == (False, True)
    model = kept.engine.runner.model
    assert isinstance(model.layers[1].moe.gate_up, QuantizedTensor)  # FP4 experts
    assert isinstance(model.layers[1].attn.wq_b, QuantizedTensor)  # an FP8 linear
    assert isinstance(model.w["lm_head.weight"], torch.Tensor)  # the writer keeps the head plain
    ids = kept.get_tokenizer().encode(PROMPTS[0])
    want, got = _prompt_logits(plain, ids), _prompt_logits(kept, ids)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    for p, k in zip(_completions(plain), _completions(kept), strict=True):
        assert k.token_ids == p.token_ids and k.logprobs == p.logprobs
    plain_bytes = plain.engine.runner.model.weight_bytes()
    assert model.weight_bytes() < plain_bytes
    assert 0 < model.quantized_weight_bytes() < model.weight_bytes()
    assert plain.engine.runner.model.quantized_weight_bytes() == 0


def test_fp8_parts_fuse_quantised_when_their_rows_are_whole_blocks(small_block_dir: Path, caplog) -> None:
    """With 32x32 blocks the attention's q_a/kv and the shared expert's gate/up concatenate their
    FP8 data and scales; the BF16 parts they were fused with (router, compressors) run as a
    second matmul.  Tokens are the dequantised model's; logits agree to rounding but not bitwise:
    MKL picks its GEMM kernel by the output width, so the router's 8 rows alone sum in another
    order than inside the 72-row fused matmul of the plain model."""
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        kept = _llm(small_block_dir, keep_quantized=True, log_level="info")
    assert "weights: " in caplog.text and "forced dequantisation" not in caplog.text
    layer = kept.engine.runner.model.layers[1]  # CSA: q_a, kv | compressor and indexer projections
    groups = [(type(w).__name__, sizes) for w, sizes in layer.attn.w_in.groups]
    assert groups == [("QuantizedTensor", [32, 32]), ("Tensor", [64, 64, 32, 32, 8])]
    assert [(type(w).__name__, sizes) for w, sizes in layer.moe.w_in.groups] == [
        ("Tensor", [8]),
        ("QuantizedTensor", [32, 32]),
    ]
    plain = _llm(small_block_dir, keep_quantized=False)
    ids = kept.get_tokenizer().encode(PROMPTS[0])
    torch.testing.assert_close(_prompt_logits(kept, ids), _prompt_logits(plain, ids), atol=1e-5, rtol=1e-5)
    assert [c.token_ids for c in _completions(kept)] == [c.token_ids for c in _completions(plain)]


def test_fusion_that_forces_dequantisation_is_logged_once_naming_the_layers(fp_dir: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        llm = _llm(fp_dir, keep_quantized=True, log_level="info")
    forced = [r.getMessage() for r in caplog.records if "forced dequantisation" in r.getMessage()]
    assert len(forced) == 1 and forced[0].startswith("fusing projections forced dequantisation")
    assert "model.layers.0.self_attn (q_a_proj, kv_proj: output dims 32, 32 are not multiples" in forced[0]
    assert "model.layers.3.mlp (shared_experts.gate_proj, shared_experts.up_proj" in forced[0]
    weights_line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: ")]
    assert len(weights_line) == 1 and "MiB of it quantised (kept: fp8_block, fp4_experts)" in weights_line[0]
    groups = llm.engine.runner.model.layers[0].attn.w_in.groups
    assert len(groups) == 1 and isinstance(groups[0][0], torch.Tensor)


@pytest.mark.slow
def test_batch_invariant_graph_decode_with_quantised_weights_is_bitwise_the_plain_model(fp_dir: Path) -> None:
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=10, logprobs=2, ignore_eos=True)
    runs = []
    for keep in (False, True):
        llm = _llm(fp_dir, keep_quantized=keep, batch_invariant=True, enforce_eager=True)
        assert llm.engine.runner.capture_graphs(EmulatedGraph) is None  # decode replays captured steps
        runs.append(_completions(llm, params))
    for p, k in zip(*runs, strict=True):
        assert k.token_ids == p.token_ids and k.logprobs == p.logprobs


def test_an_unquantised_checkpoint_with_keep_quantized_loads_normally(tiny_dir: Path) -> None:
    kept, plain = _llm(tiny_dir, keep_quantized=True), _llm(tiny_dir)
    assert kept.engine.runner.model.quantized_weight_bytes() == 0
    assert kept.engine.runner.model.weight_bytes() == plain.engine.runner.model.weight_bytes()
    ids = list(range(5, 40))
    assert torch.equal(_prompt_logits(kept, ids), _prompt_logits(plain, ids))


class _QuantPlugin:
    """A CPU backend of reference ops that declares native FP4 experts only."""

    @hookimpl
    def deepinfer_register_backends(self, register):
        register(
            BackendSpec(name="fp4cpu", device_type="cpu", priority=5, quantized_weights=("fp4_experts",))
        )


@pytest.mark.parametrize(
    ("backend", "option", "resolved", "fp4", "fp8"),
    [
        ("fp4cpu", None, True, True, False),  # default: the backend's declaration
        ("fp4cpu", False, False, False, False),
        ("fp4cpu", True, True, True, True),  # every format: fp8 falls back to dequantising ops
        ("reference", None, False, False, False),  # declares none
    ],
)
def test_default_follows_the_backends_declared_formats(fp_dir, backend, option, resolved, fp4, fp8) -> None:
    manager = manager_with_plugin(_QuantPlugin(), "quant_test")
    config = EngineConfig(model=str(fp_dir), backend=backend, keep_quantized=option, max_num_seqs=2)
    engine = LLMEngine(config, plugins=manager)
    assert engine.config.keep_quantized is resolved
    layer = engine.runner.model.layers[1]
    assert isinstance(layer.moe.gate_up, QuantizedTensor) is fp4
    assert isinstance(layer.attn.wq_b, QuantizedTensor) is fp8


def test_backend_spec_checks_its_quantized_weights() -> None:
    assert BackendSpec(name="q", device_type="cuda", quantized_weights=("fp8_block", "fp4_experts"))
    with pytest.raises(PluginError, match=r"unknown quantized_weights formats \['fp8'\]"):
        BackendSpec(name="q", device_type="cuda", quantized_weights=("fp8",))
    with pytest.raises(PluginError, match="must be a tuple"):
        BackendSpec(name="q", device_type="cuda", quantized_weights="fp8_block")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_sm100_keeps_weights_quantised_and_gives_the_dequantised_references_tokens(
    fp_dir: Path, dtype: str
) -> None:
    """On the GPU, ``cuda_sm100`` with the FP8 / FP4 weights kept quantised (its FP8 GEMM on the
    128x128-block linears, CUDA graphs on) gives the greedy tokens of the reference backend on
    the dequantised weights on the CPU, and holds fewer weight bytes."""
    gpu = LLM(
        model=str(fp_dir),
        backend="cuda_sm100",
        device="cuda",
        dtype=dtype,
        max_num_seqs=4,
        keep_quantized=True,
    )
    cpu = _llm(fp_dir, dtype=dtype, keep_quantized=False)
    model = gpu.engine.runner.model
    assert isinstance(model.layers[1].moe.gate_up, QuantizedTensor)
    assert model.quantized_weight_bytes() > 0
    assert model.weight_bytes() < cpu.engine.runner.model.weight_bytes()
    assert gpu.engine.runner.graph_manager.graphs("decode"), "CUDA graphs were not captured"
    got, want = _completions(gpu), _completions(cpu)
    for g, w in zip(got, want, strict=True):
        if dtype == "float32":  # the whole greedy continuation, logprobs within summation order
            assert g.token_ids == w.token_ids
            steps = range(len(w.token_ids))
        else:  # bf16 rounding differs between the kernels: a random tiny model's ties flip later
            assert g.token_ids[0] == w.token_ids[0]
            steps = range(1)
        tol = 1e-3 if dtype == "float32" else 0.15  # bf16: measured 0.07 on the H200
        for i in steps:
            token = w.token_ids[i]
            assert abs(g.logprobs[i][token] - w.logprobs[i][token]) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["fp_dir", "small_block_dir"])
def test_cuda_load_dequantises_on_the_gpu_bitwise(which: str, request: pytest.FixtureRequest) -> None:
    """Loading onto the GPU dequantises FP8 / FP4 tensors there (far faster than on the host)
    with bitwise the host's values."""
    from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer_core.models.deepseek_v4.loader import load_checkpoint

    model_dir = request.getfixturevalue(which)
    cfg = DeepseekV4Config.from_file(model_dir)
    host = load_checkpoint(model_dir, cfg, torch.float32, "cpu")
    gpu = load_checkpoint(model_dir, cfg, torch.float32, "cuda")
    assert host.keys() == gpu.keys()
    for name, t in host.items():
        assert gpu[name].device.type == "cuda" and torch.equal(gpu[name].cpu(), t), name
