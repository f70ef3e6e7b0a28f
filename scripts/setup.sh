#!/usr/bin/env bash
# Create (or reuse) .venv and install DeepInfer into it: CPU torch first, then the core and
# the three bundled plugins, editable.  `--test` adds the core's [test] extra.
#
#   bash scripts/setup.sh          # runtime only
#   bash scripts/setup.sh --test   # + pytest, hypothesis, transformers, ruff
#
# Environment: VENV (default .venv), PYTHON (default python3), TORCH_SPEC (default
# torch==2.13.0; pinned because an unpinned torch pulls a multi-GB CUDA build).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
EXTRA=""
if [[ "${1:-}" == "--test" ]]; then EXTRA="[test]"; fi
PLUGINS=(plugins/cuda_sm100 plugins/ascend950 plugins/samplers)

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet)

# Skip the installs when nothing that decides them changed since the last run.
stamp_src="$TORCH_SPEC $EXTRA $(cat pyproject.toml "${PLUGINS[@]/%//pyproject.toml}" | sha256sum)"
stamp="$VENV/.deepinfer-setup-$(echo "$stamp_src" | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
    "${PIP[@]}" "$TORCH_SPEC"
    editable=(-e ".$EXTRA")
    for p in "${PLUGINS[@]}"; do editable+=(-e "$p"); done
    "${PIP[@]}" "${editable[@]}"
    rm -f "$VENV"/.deepinfer-setup-*
    touch "$stamp"
fi
echo "DeepInfer is installed in $VENV (activate with: . $VENV/bin/activate)"
