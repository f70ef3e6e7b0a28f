"""``device_timeout_s``: a step whose results the device does not deliver in time ends the run
with one :class:`~deepinfer_core.errors.DeviceTimeoutError` line instead of a silent stall."""

from __future__ import annotations

import time

import pytest

from deepinfer_core import LLM
from deepinfer_core.errors import DeviceTimeoutError, user_error_line
from deepinfer_core.sampling.params import SamplingParams


@pytest.mark.gpu
def test_a_step_stalled_on_the_device_raises_the_timeout_error():
    """``cuda_sm100`` with a 0.2 s limit and ~2 s of device work queued before a step: the
    engine launches the step (async scheduling), and the next ``step()``, which reads its
    tokens, raises :class:`DeviceTimeoutError` (one ``error:`` line for the CLI) well before
    the stall ends; with the default limit the same stall only delays the tokens."""
    import torch

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for limit, stalls in ((0.2, True), (600.0, False)):
        llm = LLM(backend="cuda_sm100", device="cuda", max_num_seqs=2, device_timeout_s=limit)
        engine = llm.engine
        # The same request once first: every kernel's module is loaded before the spin (a
        # first launch behind it would wait for the device while loading)
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)
        engine.add_request("a", [5, 6, 7, 8], params)
        torch.cuda.synchronize()
        torch.cuda._sleep(4_000_000_000)  # ~2 s of spinning queued before the step's kernels
        start = time.perf_counter()
        engine.step()  # launches the prompt's step behind the spin; async: returns at once
        assert time.perf_counter() - start < 1.0, "launching the step waited for the device"
        if stalls:
            with pytest.raises(DeviceTimeoutError) as info:
                engine.step()
            line = user_error_line(info.value)
            assert line is not None and "device_timeout_s=0.2" in line and "\n" not in line
            assert not torch.cuda.current_stream().query(), "the step waited for the stall to end"
        else:
            finished = []
            while engine.has_unfinished():
                finished += engine.step()
            assert [len(out.outputs[0].token_ids) for out in finished] == [4]
        torch.cuda.synchronize()
        llm.shutdown()
