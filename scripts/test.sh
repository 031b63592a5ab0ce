#!/usr/bin/env bash
# Runs the test suite in .venv (set up by scripts/setup.sh --test). GPU tests are skipped without CUDA.
#
# With no arguments, the whole suite in two parts:
#   1. every test not marked `serial`, spread over worker processes (LORAPLEX_TEST_WORKERS, default: the
#      machine's cores, at most 4; 1 runs them in this process): they compare results, whatever the machine's load;
#   2. the tests marked `serial` (pyproject.toml's markers), one at a time, as a user's machine runs the services:
#      those that start whole systems (tests/integration, the faults and soaks of tests/reliability) and those that
#      bound a time (a failover within seconds, a cancel that frees a slot sooner than the rest of the stream would
#      take, a stalled client that slows no one), whose bound a neighbour test's load would stretch. A new test of
#      either kind marks itself (`pytestmark = pytest.mark.serial` in its file, or the mark on the test).
# Both parts run; the exit status is the first part's failure, else the second's.
# With arguments, one pytest run of exactly those arguments (e.g. a file, -k, --durations=40).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider)
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi

cores=$(nproc 2>/dev/null || echo 1)
workers=${LORAPLEX_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
spread_env=() spread_args=()
if [ "$workers" -gt 1 ]; then
  # loadfile: a file's tests run in one worker, in order, so a module's fixtures (a started system, built
  # models) are made once, and a test may build on the one before it in its file.
  # One thread each for the libraries' own pools: the workers already fill the cores.
  spread_env=(OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}")
  spread_args=(-n "$workers" --dist loadfile)
fi
trap 'exit 130' INT
echo "[test] part 1 of 2: the tests not marked serial (${workers} worker processes)"
env "${spread_env[@]}" "${pytest[@]}" "${spread_args[@]}" -m "not serial" tests
first=$?
echo "[test] part 2 of 2: the tests marked serial, one at a time"
"${pytest[@]}" -m serial tests
second=$?
[ "$first" -ne 0 ] && exit "$first"
exit "$second"
