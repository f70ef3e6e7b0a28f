#!/usr/bin/env bash
# Download the wheels a GPU machine without network needs for the GPU tier and the optional
# extras, for its Python version, into folders small enough to copy one at a time:
#
#   bash scripts/offline_wheels.sh [PYTHON_VERSION] [DEST]      # defaults: 3.12 .whl
#
#   DEST/base     pydantic and its parts, hypothesis, llguidance        (the core's dependencies
#                 that a CUDA image with torch, triton and transformers usually lacks)
#   DEST/tl       tilelang (~50 MB)
#   DEST/tl_deps  what tilelang loads: apache-tvm-ffi and z3-solver in the versions this tilelang
#                 was built against (a newer tvm-ffi or z3 makes `import tilelang` fail),
#                 torch-c-dlpack-ext, ml-dtypes, cloudpickle, psutil, tqdm; tile-kernels
#   DEST/serve    fastapi, uvicorn, openai, httpx and their dependencies (deepinfer serve's tests)
#
# Each folder stays under 64 MiB.  With SITE=1 they are also unpacked into one folder (what pip
# --target would install: each wheel's files, a .data folder's purelib / platlib merged in, its
# scripts and headers left out) packed as DEST/site.txz (xz, ~50 MB: base, tl and tl_deps), for a
# GPU machine that takes a single transfer: mkdir -p /tmp/site && tar xJf DEST/site.txz -C /tmp/site,
# then PYTHONPATH=/tmp/site.
#
# On the GPU machine: pip install --no-index --no-deps --target SITE DEST/*/*.whl, then
# PYTHONPATH=SITE bash scripts/test_gpu.sh.  tile-kernels asks for a newer torch than some CUDA
# images have; installed without its dependencies it runs on torch 2.11.
set -euo pipefail

PY="${1:-3.12}"
DEST="${2:-.whl}"
PLATFORMS=(manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64
    manylinux_2_28_x86_64 manylinux_2_34_x86_64)
fetch() {  # fetch FOLDER [--no-deps] REQUIREMENT...
    local folder="$DEST/$1"; shift
    mkdir -p "$folder"
    python3 -m pip download --quiet --only-binary=:all: --python-version "$PY" \
        "${PLATFORMS[@]/#/--platform=}" -d "$folder" "$@"
}
fetch base --no-deps pydantic pydantic-core annotated-types typing-inspection 'typing-extensions>=4.16' \
    hypothesis attrs sortedcontainers llguidance
fetch tl --no-deps 'tilelang>=0.1.15,<0.2'
fetch tl_deps --no-deps 'apache-tvm-ffi>=0.1.11,<0.1.13' 'z3-solver>=4.13,<4.15.5' \
    torch-c-dlpack-ext ml-dtypes cloudpickle psutil tqdm
if [[ "$PY" != 3.1[01] ]]; then fetch tl_deps --no-deps 'tile-kernels>=2.1'; fi
fetch serve fastapi uvicorn openai httpx
rm -f "$DEST"/serve/pydantic* "$DEST"/serve/typing_* "$DEST"/serve/annotated_types*
du -sh "$DEST"/base "$DEST"/tl "$DEST"/tl_deps "$DEST"/serve
if [[ "${SITE:-0}" == 1 ]]; then
    site="$(mktemp -d)"
    for wheel in "$DEST"/base/*.whl "$DEST"/tl/*.whl "$DEST"/tl_deps/*.whl; do
        python3 -m zipfile -e "$wheel" "$site"
    done
    for data in "$site"/*.data; do
        [[ -d "$data" ]] || continue
        for lib in purelib platlib; do
            if [[ -d "$data/$lib" ]]; then cp -r "$data/$lib"/. "$site"/; fi
        done
        rm -rf "$data"
    done
    tar cJf "$DEST/site.txz" -C "$site" .
    rm -rf "$site"
    du -sh "$DEST/site.txz"
fi
