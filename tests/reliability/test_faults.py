"""Faults against the real services: a client that stops reading, the cache killed mid-load, redis
restarted, a compute replica killed mid-stream.

One system: the cache (redis backend with its own redis-server when one is installed, else shm), two
compute replicas on the CPU and a gateway, as processes. The compute kill runs last (it leaves one
replica). Each scenario also checks that nothing is held on the live services afterwards.
"""
from __future__ import annotations

import pytest

import soak_scenarios as sc
from soak_stack import Stack, redis_available

pytestmark = [pytest.mark.serial, pytest.mark.slow, pytest.mark.timeout(600)]

# The gateway holds BUFFERED tokens for a client that is not reading (its default 4096; less here, so the stalled
# stream fills it sooner: the scenario's call took 22 s against 43 at 4096 on a CPU). STALLED_TOKENS is well past
# what the gateway buffers plus what transport windows hold (5171 tokens reached the stalled client at 1024, so
# ~4100 in its 16 KiB window and the gateway's own, measured once on the CPU)
BUFFERED, STALLED_TOKENS = 1024, 12000


@pytest.fixture(scope="module")
def stack(soak_model, soak_adapters):
    root, _ = soak_adapters
    s = Stack.start(soak_model, root, num_computes=2, backend="redis" if redis_available() else "shm",
                    compute_flags=("--max-num-seqs", "64", "--max-model-len", str(STALLED_TOKENS + 64)),
                    # far apart: failover must not wait for a health check to notice a dead replica
                    gateway_flags=("--replica-health-interval-s", "600", "--max-buffered-tokens", str(BUFFERED)))
    yield s
    s.stop()


def test_a_client_that_stops_reading_slows_no_one_and_its_stream_stays_bounded(stack):
    out = sc.stalled_reader(stack, num_beside=16, max_tokens=32, stalled_tokens=STALLED_TOKENS)
    assert out["problems"] == [], "\n".join(out["problems"])
    assert out["stalled_code"] == "RESOURCE_EXHAUSTED"
    assert f"at most {BUFFERED} per request" in out["stalled_detail"], out["stalled_detail"]   # the flag's bound
    assert out["stalled_tokens_delivered"] < STALLED_TOKENS


def test_cache_killed_mid_load_is_unavailable_then_serves_after_restart(stack, soak_adapters):
    _, names = soak_adapters
    out = sc.kill_cache(stack, names[-4:-2], recover_timeout_s=30.0)
    assert out["problems"] == [], "\n".join(out["problems"])
    assert out["loads_while_killed"].get("UNAVAILABLE")
    assert out["recovered_after_restart_s"] is not None


@pytest.mark.skipif(not redis_available(), reason="redis-server is not installed (scripts/setup.sh installs it)")
def test_redis_restarted_is_unavailable_then_named_adapters_reload(stack, soak_adapters):
    _, names = soak_adapters
    out = sc.restart_redis(stack, names[-2:], recover_timeout_s=30.0)
    assert out["problems"] == [], "\n".join(out["problems"])
    assert out["down_code"] == "UNAVAILABLE"


def test_compute_killed_mid_stream_is_unavailable_within_a_second_and_new_requests_move(stack, soak_adapters):
    _, names = soak_adapters
    # bench/soak.py holds the kill-to-error time to 1 s; a loaded 2-core CI machine gets room (the failure
    # this guards against, a break noticed only by keepalive or the caller's deadline, takes tens of seconds)
    out = sc.kill_compute(stack, names[:2], num_streams=8, num_burst=64, num_after=8, error_bound_s=5.0)
    assert out["problems"] == [], "\n".join(out["problems"])
    assert out["on_killed_replica"] >= 1 and out["kept_streaming"] >= 1, out
    assert out["kill_to_error_s"]["max"] < 5.0
    assert out["failed_after"] == 0
