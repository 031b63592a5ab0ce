"""Page allocator and residency: all-or-nothing grants, pinning, wants, LRU, drop, refusal."""
from __future__ import annotations

import pytest

from compute_service.adapter_cache.errors import AdapterTooLargeError
from compute_service.adapter_cache.pages import PageAllocator
from compute_service.adapter_cache.residency import AdapterResidency, State


def test_allocator_all_or_nothing_and_double_free():
    a = PageAllocator(5)
    got = a.alloc(3)
    assert len(set(got)) == 3 and a.num_free == 2
    with pytest.raises(RuntimeError, match="asked for 3 pages, 2 free"):
        a.alloc(3)
    assert a.num_free == 2          # nothing was taken by the refused call
    a.free(got)
    with pytest.raises(RuntimeError, match="not in use"):
        a.free(got[:1])
    assert a.num_free == 5


def _load(r: AdapterResidency) -> list[str]:
    started = r.start_loads()
    for e in started:
        r.finish_load(e.key)
    r.check()
    return [e.key for e in started]


def test_lru_evicts_least_recently_used_idle_only():
    evicted: list[str] = []
    r = AdapterResidency(num_pages=10, max_slots=8, on_evict=lambda e: evicted.append(e.key))
    for k in "abc":
        r.want(k, 3)
    assert _load(r) == ["a", "b", "c"]
    for k in "abc":
        r.pin(k)
    r.unpin("a"); r.unwant("a")      # a idle, oldest use
    r.unpin("c"); r.unwant("c")      # c idle, newer
    r.want("d", 4)                   # needs 4: 1 free + evict a (3)
    assert _load(r) == ["d"]
    assert evicted == ["a"] and r.is_ready("c") and r.is_ready("b")


def test_pinned_and_wanted_never_evicted_request_waits():
    r = AdapterResidency(num_pages=6, max_slots=8, on_evict=lambda e: pytest.fail(f"evicted {e.key}"))
    r.want("a", 3); r.want("b", 3)
    _load(r)
    r.pin("a")                       # running
    # b is wanted by a waiting request: resident but not pinned, still protected
    r.want("c", 2)
    assert r.start_loads() == [] and r.get("c").state is State.QUEUED
    r.check()


def test_queue_head_not_overtaken_and_loads_after_release():
    r = AdapterResidency(num_pages=6, max_slots=8)
    r.want("a", 5); _load(r); r.pin("a")
    r.want("big", 4)
    r.want("small", 1)               # would fit now, but must not overtake "big"
    assert r.start_loads() == []
    r.unpin("a"); r.unwant("a")
    assert _load(r) == ["big", "small"] and not r.is_ready("a")


def test_slots_bound_residency_like_pages():
    r = AdapterResidency(num_pages=100, max_slots=2)
    r.want("a", 1); r.want("b", 1); r.want("c", 1)
    assert _load(r) == ["a", "b"]
    r.unwant("a")
    assert _load(r) == ["c"] and not r.is_ready("a")


def test_too_large_refused_with_size_and_capacity():
    r = AdapterResidency(num_pages=4, max_slots=2, page_bytes=1000)
    with pytest.raises(AdapterTooLargeError, match=r"needs 5 pages \(5000 bytes\).*holds 4 pages \(4000 bytes\)"):
        r.want("huge", 5)
    assert r.get("huge") is None


def test_aborted_before_load_leaves_queue_and_drop_waits_for_idle():
    r = AdapterResidency(num_pages=4, max_slots=2)
    r.want("a", 4); _load(r); r.pin("a")
    r.want("b", 2)
    r.unwant("b")                    # its only request went away while queued
    assert r.get("b") is None and r.num_queued == 0
    assert r.drop("a") and r.is_ready("a")   # busy: dropped once idle
    r.unpin("a"); r.unwant("a")
    assert r.get("a") is None and r.pages.num_used == 0
    r.check()


def test_prefetch_loads_without_request_and_is_evictable():
    r = AdapterResidency(num_pages=4, max_slots=4)
    r.prefetch("p", 3)
    assert _load(r) == ["p"] and r.get("p").idle
    r.want("q", 2)
    assert _load(r) == ["q"] and r.get("p") is None


def test_failed_load_returns_pages_and_slot():
    r = AdapterResidency(num_pages=4, max_slots=1)
    r.want("a", 4)
    (e,) = r.start_loads()
    r.fail_load("a")
    assert r.pages.num_used == 0 and r.get("a") is None
    r.want("b", 4)
    assert _load(r) == ["b"]
