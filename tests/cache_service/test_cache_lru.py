"""LruIndex against a plain model of LRU-by-bytes, over random put/get/evict sequences."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.errors import ResourceExhaustedError
from cache_service.lru import LruEntry, LruIndex

BUDGET = 1000
ops = st.lists(st.tuples(st.sampled_from(["put", "get", "evict"]), st.integers(0, 7),
                         st.integers(1, 1200)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_matches_model(sequence):
    index = LruIndex(BUDGET)
    model: list[tuple[int, int]] = []  # (task id, bytes), least recently used first
    for op, task_id, size in sequence:
        if op == "put":
            if size > BUDGET:
                with pytest.raises(ResourceExhaustedError, match=f"{size} bytes.*{BUDGET}"):
                    index.admit(LruEntry(task_id, "v", size))
                continue
            model = [(t, b) for t, b in model if t != task_id]
            expected_evicted = []
            while sum(b for _, b in model) + size > BUDGET:
                expected_evicted.append(model.pop(0)[0])
            model.append((task_id, size))
            evicted = index.admit(LruEntry(task_id, "v", size))
            assert [e.task_id for e in evicted] == expected_evicted
        elif op == "get":
            hit = index.touch(task_id)
            found = [m for m in model if m[0] == task_id]
            assert (hit is not None) == bool(found)
            if found:
                model.remove(found[0])
                model.append(found[0])
        else:
            removed = index.remove(task_id)
            assert (removed is not None) == any(t == task_id for t, _ in model)
            model = [(t, b) for t, b in model if t != task_id]
        assert [(e.task_id, e.num_bytes) for e in index.order()] == model
        assert index.bytes_used == sum(b for _, b in model) <= BUDGET
