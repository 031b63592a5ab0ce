#!/usr/bin/env bash
# Runs the test suite in .venv (set up by scripts/setup.sh --test). GPU tests are skipped without CUDA.
#
# With no arguments, the whole suite in two parts:
#   1. every test but those below, spread over worker processes (LORAPLEX_TEST_WORKERS, default: the machine's
#      cores, at most 4; 1 runs them in this process): they compare results, whatever the machine's load;
#   2. the tests that start whole systems (tests/integration, the faults and soaks of tests/reliability; its
#      transport test only waits on gRPC's 30 s, in part 1) and those that bound a time (a failover within
#      seconds, a cancel that frees a slot sooner than the rest of the stream would take, a stalled client that
#      slows no one), one at a time, as a user's machine runs the services: a neighbour test's load would
#      stretch what they time. A new test that bounds a time goes here.
# Both parts run; the exit status is the first part's failure, else the second's.
# With arguments, one pytest run of exactly those arguments (e.g. a file, -k, --durations=40).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider)
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi

serial=(tests/integration tests/reliability/test_faults.py tests/reliability/test_soak.py
        tests/reliability/test_soak_script.py
        tests/compute_service/test_engine_process.py tests/compute_service/test_compute_grpc.py
        tests/compute_service/test_token_stream.py tests/cache_service/test_cache_client_reconnect.py
        tests/cache_service/test_cache_shm_spares.py tests/cache_service/test_cache_redis_restart.py
        tests/parallel/test_tp_rank_failure.py tests/parallel/test_step_channel.py)
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
ignore=()
for p in "${serial[@]}"; do ignore+=(--ignore="$p"); done
trap 'exit 130' INT
echo "[test] part 1 of 2: every test but those of part 2 (${workers} worker processes)"
env "${spread_env[@]}" "${pytest[@]}" "${spread_args[@]}" tests "${ignore[@]}"
first=$?
echo "[test] part 2 of 2: ${serial[*]}, one test at a time"
"${pytest[@]}" "${serial[@]}"
second=$?
[ "$first" -ne 0 ] && exit "$first"
exit "$second"
