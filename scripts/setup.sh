#!/usr/bin/env bash
# Create (or reuse) .venv and install DeepInfer into it: CPU torch first, then the core and
# the four bundled plugins, editable, the samplers plugin with its [structured] extra
# (llguidance: --choice, --regex, --json-schema, --grammar), then compiles the cpu backend's C++
# kernels into $DEEPINFER_KERNEL_CACHE (once).  `--test` adds the [test] extras.
#
#   bash scripts/setup.sh                   # runtime
#   bash scripts/setup.sh --test            # + pytest, hypothesis, transformers, huggingface_hub, ruff
#   bash scripts/setup.sh --print-installs  # print the editable installs' pip arguments, one a line
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
PRINT_ONLY=""
for arg in "$@"; do
    case "$arg" in
        --test) EXTRA="[test]" ;;
        --print-installs) PRINT_ONLY=1 ;;
        *) echo "error: unknown argument $arg: use --test and/or --print-installs" >&2; exit 2 ;;
    esac
done
PLUGINS=(plugins/cpu plugins/cuda_sm100 plugins/ascend950 plugins/samplers)

# The editable installs: the core, then each plugin with the extra it needs.
editable=(-e ".$EXTRA")
for p in "${PLUGINS[@]}"; do
    if [[ -n "$EXTRA" && ( "$p" == plugins/cuda_sm100 || "$p" == plugins/samplers ) ]]; then
        # the cuda_sm100 tests run its Triton kernels in Triton's CPU interpreter: [test] adds
        # triton; the samplers tests run both grammar backends and validate with jsonschema:
        # [test] adds llguidance, xgrammar and jsonschema
        editable+=(-e "$p[test]")
    elif [[ "$p" == plugins/samplers ]]; then
        editable+=(-e "$p[structured]")  # structured outputs work right after set-up
    else
        editable+=(-e "$p")
    fi
done
if [[ -n "$PRINT_ONLY" ]]; then
    printf '%s\n' "${editable[@]}"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet)

# Skip the installs when nothing that decides them changed since the last run.
stamp_src="$TORCH_SPEC $TORCH_INDEX_URL ${editable[*]} $(cat pyproject.toml "${PLUGINS[@]/%//pyproject.toml}" | sha256sum)"
stamp="$VENV/.deepinfer-setup-$(echo "$stamp_src" | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
    if [[ -n "$TORCH_INDEX_URL" ]]; then
        "${PIP[@]}" --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
    else
        "${PIP[@]}" "$TORCH_SPEC"
    fi
    "${PIP[@]}" "${editable[@]}"
    rm -f "$VENV"/.deepinfer-setup-*
    touch "$stamp"
fi
# The cpu backend's C++ kernels, compiled once into $DEEPINFER_KERNEL_CACHE (default ~/.cache/deepinfer/kernels; skipped when cached;
# without a C++ compiler the cpu backend reports itself unavailable and the reference runs).
"$VENV/bin/python" -m deepinfer_cpu.build || echo "warning: the cpu backend's kernels were not built (see above); the reference backend runs instead" >&2
"$VENV/bin/python" -c 'import torch; print("torch", torch.__version__, "(CUDA " + torch.version.cuda + ")" if torch.version.cuda else "(CPU build)")'
echo "DeepInfer is installed in $VENV (activate with: . $VENV/bin/activate)"
