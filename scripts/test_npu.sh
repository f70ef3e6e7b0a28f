#!/usr/bin/env bash
# The NPU tier: every test marked `npu` (the ascend950 backend's ops against the reference with
# the real torch_npu operators on device "npu", greedy tokens of the operator-shaped tiny models
# against the reference, batch invariance of the per-element ops), on a machine with an Ascend
# 950 NPU, the CANN toolkit and a torch_npu build matching its torch and CANN (targeted:
# torch_npu 2.14.0).  Nothing here has run on an NPU yet (plugins/ascend950/README.md).
#
#   bash scripts/test_npu.sh              # all npu tests
#   bash scripts/test_npu.sh -k conformance  # extra arguments go to pytest
#
# It uses the Python that already has torch_npu: PYTHON, else .venv/bin/python where that
# exists, else python3.  The core and the plugins are installed into it (editable, no
# dependencies) when they are not there yet; their dependencies must be (pip install -e .).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -n "${PYTHON:-}" ]]; then :; elif [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi

if ! "$PYTHON" -c 'import importlib.metadata as m; [m.version(p) for p in ("deepinfer-core", "deepinfer-ascend950", "deepinfer-samplers", "deepinfer-cpu")]' 2>/dev/null; then
    "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation \
        -e . -e plugins/ascend950 -e plugins/samplers -e plugins/cpu
fi
"$PYTHON" -c 'import sys; from conftest import npu_unavailable_reason as r; why = r(); why and sys.exit(f"error: the npu tests cannot run here: {why}")'
"$PYTHON" -m pytest -q -p no:cacheprovider -m npu "$@"
