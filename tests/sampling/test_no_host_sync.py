"""The sampler makes no host sync on the step's tensors: every stage (masks, bias, bans,
penalties, temperature, top-k / top-p / min-p, the counter-based draw, logprobs) is device work
on shapes the host fixed from the batch's parameters; the host reads the logprobs only when
they are first accessed.

On CPU the syncs are recorded as the ops that would make one on CUDA (``tests/ops/sync_check``);
with a CUDA device the sampler also runs under ``torch.cuda.set_sync_debug_mode("error")`` and
replays inside a captured CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.sampling.batch import SamplingBatch
from deepinfer_core.sampling.logprobs import top_logprobs
from deepinfer_core.sampling.sampler import Sampler
from tests.ops.sync_check import record_host_syncs

needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)

B, V = 6, 64


def _batch(kind: str) -> SamplingBatch:
    rows = list(range(B))
    base = dict(seeds=[7 * i for i in rows], positions=[10 + i for i in rows])
    if kind == "greedy":
        return SamplingBatch([0.0] * B, [1.0] * B, [0] * B, **base)
    if kind == "sampled":
        return SamplingBatch([0.8] * B, [0.9] * B, [5] * B, min_ps=[0.05] * B, **base)
    if kind == "plain_draw":  # no filter stage at all
        return SamplingBatch([1.0] * B, [1.0] * B, [0] * B, **base)
    if kind == "logprobs_every_row":
        return SamplingBatch([0.0, 1.0] * (B // 2), [1.0] * B, [0] * B, num_logprobs=[3] * B, **base)
    assert kind == "everything"
    return SamplingBatch(
        temperatures=[0.0, 1.0, 0.7, 0.0, 1.3, 0.5],
        top_ps=[1.0, 0.9, 1.0, 1.0, 0.5, 1.0],
        top_ks=[0, 5, 0, 0, -1, 3],
        num_logprobs=[None, 2, 0, None, 5, 1],
        min_ps=[0.0, 0.1, 0.0, 0.0, 0.0, 0.0],
        presence_penalties=[0.1, 0.0, 0.5, 0.0, 0.0, 1.0],
        frequency_penalties=[0.2, 0.0, 0.0, 0.3, 0.0, 0.0],
        repetition_penalties=[1.2, 1.0, 1.0, 0.8, 1.0, 1.0],
        prompt_token_ids=[[1, 2], [], [3, 3, 4], [5], [6, 7], [8]],
        output_token_ids=[[3], [9, 9], [], [10], [], [11, 12]],
        logit_bias=[{1: 2.0, 4: -3.0}, None, {5: 1.5}, None, None, None],
        allowed_token_ids=[None, [1, 2, 3, 9], None, None, [0, 1], None],
        banned_token_ids=[[0], [], [], [2, 3], [], []],
        **base,
    )


KINDS = ["greedy", "sampled", "plain_draw", "logprobs_every_row", "everything"]


def _logits(device: str = "cpu") -> torch.Tensor:
    return (torch.randn(B, V, generator=torch.Generator().manual_seed(0)) * 3).to(device)


@pytest.mark.parametrize("kind", KINDS)
def test_sampler_makes_no_host_sync(kind):
    logits, batch = _logits(), _batch(kind)
    want = Sampler()(logits, batch)
    with record_host_syncs() as syncs:
        out = Sampler()(logits, batch)
    assert syncs == []
    assert torch.equal(out.token_ids, want.token_ids)
    assert list(out.logprobs) == list(want.logprobs)


def test_logprobs_are_read_only_when_accessed():
    logits, batch = _logits(), _batch("everything")
    with record_host_syncs() as syncs:
        out = Sampler()(logits, batch)
        assert len(out.logprobs) == B  # known on the host: no read
    assert syncs == []
    with record_host_syncs() as syncs:
        entry = out.logprobs[1]
    assert syncs  # the one read, when the outputs are processed
    ref = top_logprobs(logits, out.token_ids, batch.num_logprobs)
    assert entry == ref[1] and list(out.logprobs) == list(ref)
    tok = int(out.token_ids[2])
    assert out.logprobs[0] is None and out.logprobs[2] == {tok: ref[2][tok]}  # k = 0: the token only


def test_process_logits_makes_no_host_sync():
    logits, batch = _logits(), _batch("everything")
    with record_host_syncs() as syncs:
        Sampler().process_logits(logits, batch)
    assert syncs == []


def test_host_stage_decisions_read_the_parameters_as_fp32():
    """A stage is skipped on the host exactly when the device (fp32 parameters) would change
    nothing: a top-p or repetition penalty that rounds to 1, a min-p that rounds to 0, a
    temperature that rounds to 0 (greedy)."""
    n = 2
    b = SamplingBatch(
        temperatures=[1e-50, 1.0],
        top_ps=[1.0, 1.0 - 1e-12],
        top_ks=[0, 0],
        seeds=[1, 2],
        positions=[0, 0],
        min_ps=[0.0, 1e-60],
        presence_penalties=[0.0] * n,
        frequency_penalties=[0.0] * n,
        repetition_penalties=[1.0 + 1e-12] * n,
        prompt_token_ids=[[1]] * n,
        output_token_ids=[[2]] * n,
    )
    prep = b.prepare("cpu", V)
    assert prep.sample_rows == [1]
    assert not prep.use_top_k_top_p and not prep.use_min_p and not prep.use_repetition
    assert prep.prompt_ids is None and prep.top_ps is None and prep.min_ps is None


def test_parameters_travel_as_one_buffer():
    """Every per-row tensor is a view of one converted block per dtype (one host-to-device copy)."""
    prep = _batch("everything").prepare("cpu", V)
    int_fields = [prep.sample_index, prep.top_ks, prep.key1, prep.key2, prep.bias_ids, prep.output_ids]
    assert len({t.untyped_storage().data_ptr() for t in int_fields if t is not None}) == 1
    float_fields = [prep.temperatures, prep.top_ps, prep.min_ps, prep.bias_values, prep.presence]
    assert len({t.untyped_storage().data_ptr() for t in float_fields if t is not None}) == 1


def test_out_of_vocabulary_ids_are_rejected_on_the_host():
    b = SamplingBatch([0.0], [1.0], [0], [0], [0], banned_token_ids=[[V + 3]])
    with pytest.raises(ValueError, match="banned_token_ids"):
        Sampler()(_logits()[:1], b)


# ---- on a CUDA device --------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("kind", KINDS)
def test_sampler_on_cuda_makes_no_host_sync(kind):
    logits, batch = _logits("cuda"), _batch(kind)
    Sampler()(logits, batch).logprobs[0]  # warm-up: lazy initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = Sampler()(logits.cpu(), batch)
    greedy = [i for i, t in enumerate(batch.temperatures) if t == 0]
    assert out.token_ids.device.type == "cuda"
    assert out.token_ids.cpu()[greedy].tolist() == cpu.token_ids[greedy].tolist()
    for got, want in zip(out.logprobs, cpu.logprobs, strict=True):
        assert (got is None) == (want is None)


@needs_cuda
@pytest.mark.parametrize("kind", KINDS)
def test_sampling_step_replays_in_a_cuda_graph(kind):
    logits, batch = _logits("cuda"), _batch(kind)
    sampler = Sampler()
    prep = batch.prepare(logits.device, V)
    eager_tokens, eager_lp = sampler.sample(logits, prep)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sampler.sample(logits, prep)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, lp = sampler.sample(logits, prep)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(tokens, eager_tokens)
    assert (lp is None) == (eager_lp is None)
    if lp is not None:
        assert torch.equal(lp, eager_lp)
