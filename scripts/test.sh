#!/usr/bin/env bash
# Runs the test suite in .venv (set up by scripts/setup.sh --test). GPU tests are skipped without CUDA.
#
# With no arguments, the whole suite in two parts:
#   1. every test but those below, spread over worker processes (LORAPLEX_TEST_WORKERS, default: the machine's
#      cores, at most 4; 1 runs them in this process): they compare results, whatever the machine's load;
#   2. the tests that bound a time (a failover within seconds, a cancel that frees a slot sooner than the rest
#      of the stream would take, a stalled client that slows no one), one at a time, as a user's machine runs the
#      services: a neighbour test's load would stretch what they time. A new test that bounds a time goes here.
# Both parts run; the exit status is the first part's failure, else the second's.
# With arguments, one pytest run of exactly those arguments (e.g. a file, -k, --durations=40).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider)
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi

serial=(tests/reliability tests/compute_service tests/parallel tests/cache_service
        tests/integration/test_token_stream.py tests/integration/test_replicas_processes.py)
also_spread=(tests/reliability/test_transport.py)    # in a folder above, but it only waits (30 s of gRPC's)
cores=$(nproc 2>/dev/null || echo 1)
workers=${LORAPLEX_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
spread_env=() spread_args=()
if [ "$workers" -gt 1 ]; then
  # worksteal: each worker starts on a contiguous share, so module fixtures are built about once per worker.
  # One thread each for the libraries' own pools: the workers already fill the cores.
  spread_env=(OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}")
  spread_args=(-n "$workers" --dist worksteal)
fi
ignore=()
for p in "${serial[@]}"; do ignore+=(--ignore="$p"); done
trap 'exit 130' INT
echo "[test] part 1 of 2: every test but those that time themselves (${workers} worker processes)"
env "${spread_env[@]}" "${pytest[@]}" "${spread_args[@]}" tests "${also_spread[@]}" "${ignore[@]}"
first=$?
echo "[test] part 2 of 2: ${serial[*]}, one test at a time"
"${pytest[@]}" "${serial[@]}" "${also_spread[@]/#/--ignore=}"
second=$?
[ "$first" -ne 0 ] && exit "$first"
exit "$second"
