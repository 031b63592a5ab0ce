#!/usr/bin/env bash
# Runs the test suite in .venv (set up by scripts/setup.sh --test).
# GPU tests are skipped without CUDA. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
