#!/usr/bin/env bash
# Create (or reuse) .venv and install DeepInfer into it: CPU torch first, then the core and
# the three bundled plugins, editable.  `--test` adds the core's [test] extra.
#
#   bash scripts/setup.sh          # runtime only
#   bash scripts/setup.sh --test   # + pytest, hypothesis, transformers, huggingface_hub, ruff
#
# Environment: VENV (default .venv), PYTHON (default python3), TORCH_SPEC (default
# torch==2.13.0), TORCH_INDEX_URL (an index to take torch from, e.g. PyTorch's CPU index;
# default: pip's configured indexes, where on Linux x86-64 PyPI's torch is the CUDA build).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
EXTRA=""
if [[ "${1:-}" == "--test" ]]; then EXTRA="[test]"; fi
PLUGINS=(plugins/cuda_sm100 plugins/ascend950 plugins/samplers)

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet)

# Skip the installs when nothing that decides them changed since the last run.
stamp_src="$TORCH_SPEC $TORCH_INDEX_URL $EXTRA $(cat pyproject.toml "${PLUGINS[@]/%//pyproject.toml}" | sha256sum)"
stamp="$VENV/.deepinfer-setup-$(echo "$stamp_src" | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
    if [[ -n "$TORCH_INDEX_URL" ]]; then
        "${PIP[@]}" --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
    else
        "${PIP[@]}" "$TORCH_SPEC"
    fi
    editable=(-e ".$EXTRA")
    for p in "${PLUGINS[@]}"; do
        # the cuda_sm100 tests run its Triton kernels in Triton's CPU interpreter: [test] adds triton
        # the samplers tests run structured outputs through llguidance and validate with
        # jsonschema: [test] adds both
        if [[ -n "$EXTRA" && "$p" == plugins/cuda_sm100 ]]; then editable+=(-e "$p[test]")
        elif [[ -n "$EXTRA" && "$p" == plugins/samplers ]]; then editable+=(-e "$p[test]")
        else editable+=(-e "$p"); fi
    done
    "${PIP[@]}" "${editable[@]}"
    rm -f "$VENV"/.deepinfer-setup-*
    touch "$stamp"
fi
"$VENV/bin/python" -c 'import torch; print("torch", torch.__version__, "(CUDA " + torch.version.cuda + ")" if torch.version.cuda else "(CPU build)")'
echo "DeepInfer is installed in $VENV (activate with: . $VENV/bin/activate)"
