"""The routing rule over compute replicas: affinity, spill, load, health (gateway/replicas.py)."""
from __future__ import annotations

import collections
import os
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.replicas import (NoReplicaError, ReplicaSet, format_address, is_dns_target,
                              rendezvous_order, split_target)

ADDRS = [f"10.0.0.{i}:50053" for i in range(1, 5)]
addresses = st.lists(st.from_regex(r"[a-z]{1,8}:[1-9][0-9]{0,3}", fullmatch=True), min_size=1, max_size=8,
                     unique=True)
keys = st.text(min_size=0, max_size=12)


def home_of(key: str, addrs) -> str:
    return rendezvous_order(key, addrs)[0]


def test_homes_agree_across_processes():
    """Two gateways (different hash seeds) send an adapter to the same replica."""
    here = [home_of(str(k), ADDRS) for k in range(50)]
    code = ("import sys; from gateway.replicas import rendezvous_order as r; "
            f"print(','.join(r(str(k), {ADDRS!r})[0] for k in range(50)))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, PYTHONHASHSEED=seed), check=True)
        assert out.stdout.strip().split(",") == here


def test_repeated_adapter_goes_to_the_same_replica():
    rs = ReplicaSet(ADDRS)
    for task_id in random.sample(range(1 << 40), 20):
        picks = set()
        for _ in range(10):
            a = rs.choose(str(task_id))
            rs.acquire(a)
            rs.release(a)
            picks.add(a)
        assert picks == {home_of(str(task_id), ADDRS)}


def test_adapters_spread_over_replicas():
    counts = collections.Counter(ReplicaSet(ADDRS).choose(str(k)) for k in range(2000))
    assert set(counts) == set(ADDRS)
    for a in ADDRS:
        assert 0.18 < counts[a] / 2000 < 0.32, counts


@settings(max_examples=100, deadline=None)
@given(addrs=addresses.filter(lambda a: len(a) >= 2), key=keys, data=st.data())
def test_losing_a_replica_moves_only_its_adapters(addrs, key, data):
    gone = data.draw(st.sampled_from(addrs))
    before = ReplicaSet(addrs).choose(key)
    rs = ReplicaSet(addrs)
    rs.mark_down(gone, "test")
    after = rs.choose(key)
    if before != gone:
        assert after == before
    else:
        assert after == rendezvous_order(key, addrs)[1], "moves to its second choice"
    rs.mark_up(gone)
    assert rs.choose(key) == before, "comes home when the replica is back"


@settings(max_examples=100, deadline=None)
@given(addrs=addresses, key=keys, new=st.from_regex(r"[A-Z]{3}:1[0-9]{3}", fullmatch=True))
def test_adding_a_replica_moves_adapters_only_to_it(addrs, key, new):
    before = ReplicaSet(addrs).choose(key)
    after = ReplicaSet(addrs + [new]).choose(key)
    assert after in (before, new)


def test_saturated_home_spills_to_the_least_loaded():
    rs = ReplicaSet(ADDRS, spill_threshold=3)
    key = "7"
    order = rendezvous_order(key, ADDRS)
    home = order[0]
    for _ in range(2):
        rs.acquire(home)
    rs.acquire(order[1])
    assert rs.choose(key) == home, "below the threshold the home keeps it, even with idle replicas"
    rs.acquire(home)  # 3 in flight: saturated
    # order[2] and order[3] are idle: the tie goes to the better-ranked one
    assert rs.choose(key) == order[2]
    rs.acquire(order[2])
    rs.acquire(order[3])
    rs.acquire(order[3])
    # loads: home 3, order[1] 1, order[2] 1, order[3] 2 -> least loaded, best rank
    assert rs.choose(key) == order[1]
    rs.release(home)
    assert rs.choose(key) == home


def test_everything_saturated_stays_home():
    rs = ReplicaSet(ADDRS, spill_threshold=1)
    for a in ADDRS:
        rs.acquire(a)
    assert rs.choose("x") == home_of("x", ADDRS)


@settings(max_examples=100, deadline=None)
@given(addrs=addresses, n=st.integers(1, 60))
def test_sequential_base_requests_take_turns(addrs, n):
    rs = ReplicaSet(addrs)
    counts = collections.Counter()
    for _ in range(n):
        a = rs.choose(None)
        rs.acquire(a)
        rs.release(a)
        counts[a] += 1
    assert max(counts.values()) - min(counts.get(a, 0) for a in addrs) <= 1


def test_base_requests_go_to_the_least_loaded():
    rs = ReplicaSet(ADDRS)
    loads = {ADDRS[0]: 5, ADDRS[1]: 2, ADDRS[2]: 4, ADDRS[3]: 3}
    for a, n in loads.items():
        for _ in range(n):
            rs.acquire(a)
    assert rs.choose(None) == ADDRS[1]
    # concurrent requests fill the replicas up evenly
    picked = []
    for _ in range(8):
        a = rs.choose(None)
        rs.acquire(a)
        picked.append(a)
    assert sorted(rs.state(a).num_in_flight for a in ADDRS) == [5, 5, 6, 6]


def test_health_takes_replicas_out_and_back():
    rs = ReplicaSet(ADDRS[:2])
    assert rs.mark_down(ADDRS[0], "connection refused") is True
    assert rs.mark_down(ADDRS[0], "again") is False, "reported once"
    assert rs.state(ADDRS[0]).reason == "again"
    for _ in range(10):
        assert rs.choose(None) == ADDRS[1]
        assert rs.choose(str(random.random())) == ADDRS[1]
    assert rs.mark_up(ADDRS[0]) is True and rs.mark_up(ADDRS[0]) is False
    assert {rs.choose(None) for _ in range(4)} == set(ADDRS[:2])


def test_all_out_still_tries_them_and_exclude_ends_the_retries():
    rs = ReplicaSet(ADDRS[:2])
    for a in ADDRS[:2]:
        rs.mark_down(a, "health check failed")
    key = "adapter-3"
    first = rs.choose(key)
    assert first == home_of(key, ADDRS[:2])
    second = rs.choose(key, exclude=[first])
    assert second != first
    with pytest.raises(NoReplicaError, match="every compute replica failed"):
        rs.choose(key, exclude=ADDRS[:2])
    with pytest.raises(NoReplicaError, match="no compute replica is known"):
        ReplicaSet([]).choose(None)


def test_a_healthy_replica_beats_an_excluded_or_unhealthy_one():
    rs = ReplicaSet(ADDRS)
    rs.mark_down(ADDRS[0], "down")
    for key in map(str, range(100)):
        assert rs.choose(key, exclude=[ADDRS[1]]) in ADDRS[2:]


def test_membership_changes_keep_state():
    rs = ReplicaSet(ADDRS[:2])
    rs.acquire(ADDRS[0])
    rs.mark_down(ADDRS[1], "down")
    added, removed = rs.set_addresses([ADDRS[0], ADDRS[2], ADDRS[2]], healthy=False)
    assert (added, removed) == ([ADDRS[2]], [ADDRS[1]])
    assert rs.addresses == [ADDRS[0], ADDRS[2]]
    assert rs.state(ADDRS[0]).num_in_flight == 1 and rs.state(ADDRS[0]).healthy
    assert not rs.state(ADDRS[2]).healthy, "new replicas wait for their first health check"
    rs.release(ADDRS[1])  # a request that outlived its replica's removal
    rs.release(ADDRS[0])
    rs.release(ADDRS[0])
    assert rs.state(ADDRS[0]).num_in_flight == 0


@settings(max_examples=100, deadline=None)
@given(addrs=addresses, data=st.data())
def test_choose_respects_health_and_exclusion(addrs, data):
    rs = ReplicaSet(addrs, spill_threshold=data.draw(st.integers(1, 4)))
    down = data.draw(st.sets(st.sampled_from(addrs)))
    excluded = data.draw(st.sets(st.sampled_from(addrs)))
    for a in down:
        rs.mark_down(a, "down")
    for a in addrs:
        for _ in range(data.draw(st.integers(0, 5))):
            rs.acquire(a)
    key = data.draw(st.one_of(st.none(), keys))
    left = [a for a in addrs if a not in excluded]
    if not left:
        with pytest.raises(NoReplicaError):
            rs.choose(key, exclude=excluded)
        return
    pick = rs.choose(key, exclude=excluded)
    assert pick in left
    if any(a not in down for a in left):
        assert pick not in down


def test_addresses_parse():
    assert split_target("compute:50053") == ("compute", 50053)
    assert split_target("dns:///compute:50053") == ("compute", 50053)
    assert split_target("[::1]:7") == ("::1", 7)
    assert is_dns_target("dns:///compute:50053") and not is_dns_target("compute:50053")
    assert format_address("::1", 7) == "[::1]:7" and format_address("10.0.0.1", 7) == "10.0.0.1:7"
    for bad in ("compute", "compute:", ":50053", "compute:http", "compute:70000", "dns:///compute"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            split_target(bad)
