#!/usr/bin/env bash
# Set up .venv with the test extras (see scripts/setup.sh), then run the whole test suite
# and the linters.  Extra arguments go to pytest, e.g. `bash scripts/test.sh -k tiny`.
# `--fast` (anywhere among them) runs the fast tier instead: pytest -m "not slow", the tests
# not marked slow (docs/testing.md); the linters still run.  CI runs everything.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --test
VENV="${VENV:-.venv}"
ARGS=()
for arg in "$@"; do
    if [[ "$arg" == "--fast" ]]; then ARGS+=(-m "not slow"); else ARGS+=("$arg"); fi
done
# pytest exits 5 when it collected no test; `set -e` turns that into a failure too.
"$VENV/bin/python" -m pytest -q ${ARGS[@]+"${ARGS[@]}"}
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
