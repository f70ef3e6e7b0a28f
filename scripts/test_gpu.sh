#!/usr/bin/env bash
# The GPU tier: every test marked `gpu` (kernels, CUDA graphs, batch invariance, quantised
# weights, speculative decoding and DeepSeek-V4.1 on the GPU), on a machine whose GPU the
# cuda_sm100 backend runs on (NVIDIA, compute capability >= 9.0, torch with CUDA, Triton).
#
#   bash scripts/test_gpu.sh              # all gpu tests, spread over GPU_TEST_WORKERS processes
#   bash scripts/test_gpu.sh -k attention # extra arguments go to pytest
#   DEEPINFER_TEST_FAILURE_LOG=/tmp/failures.txt bash scripts/test_gpu.sh  # each failure's report
#                                         # written as it happens (conftest.py)
#   DEEPINFER_TEST_DURATION_LOG=/tmp/durations.txt bash scripts/test_gpu.sh  # each test's seconds
#                                         # as it ends (conftest.py)
#   DEEPINFER_TEST_SHARD=1/2 bash scripts/test_gpu.sh  # every 2nd test from the 1st; 2/2 runs the rest
#
# It uses the Python that already has torch with CUDA: PYTHON, else .venv/bin/python where
# that exists, else python3.  The core and the plugins are installed into it (editable, no
# dependencies) when they are not there yet; their dependencies must be (pip install -e .).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -n "${PYTHON:-}" ]]; then :; elif [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
# workers: GPU_TEST_WORKERS, else 8, fewer on a GPU of under 88 GiB (about 11 GiB a worker: the
# V4-Flash-width tests take up to ~20 GiB each, and 14 workers ran out of an 80 GiB H100's memory)
WORKERS="${GPU_TEST_WORKERS:-$("$PYTHON" -c 'import torch; g = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 88; print(max(1, min(8, int(g // 11))))' 2>/dev/null || echo 8)}"

if ! "$PYTHON" -c 'import importlib.metadata as m; [m.version(p) for p in ("deepinfer-core", "deepinfer-cuda-sm100", "deepinfer-samplers", "deepinfer-cpu")]' 2>/dev/null; then
    "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation \
        -e . -e plugins/cuda_sm100 -e plugins/samplers -e plugins/ascend950 -e plugins/cpu
fi
"$PYTHON" -c 'import sys; from conftest import gpu_unavailable_reason as r; why = r(); why and sys.exit(f"error: the gpu tests cannot run here: {why}")'
# TileLang kernels (where TileLang is installed): compiled in parallel before the tests use them
if "$PYTHON" -c 'import sys; from deepinfer_cuda_sm100.tl import tilelang_problem as p; sys.exit(p() is not None)' 2>/dev/null; then
    "$PYTHON" -m deepinfer_cuda_sm100.tl.precompile --jobs "$WORKERS"
fi
# a test still running after this many seconds dumps its stacks and ends its worker (conftest.py)
export DEEPINFER_TEST_TIMEOUT_S="${DEEPINFER_TEST_TIMEOUT_S:-300}"
"$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -n "$WORKERS" "$@"
