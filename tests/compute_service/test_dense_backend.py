"""The CPU LoRA backend's per-adapter copies: built as a load lands, never by a step, rebuilt on replacement."""
from __future__ import annotations

import threading

import torch
from compute_helpers import random_adapter

import compute_service.adapter_cache.dense_backend as dense_backend
from compute_service.adapter_cache.backends import lora_backend_for
from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.engine.spec import ModelSpec

SPEC = ModelSpec(architecture="llama", num_layers=2, hidden_size=48, num_heads=3, num_kv_heads=1, head_dim=16,
                 intermediate_size=80, vocab_size=50, rms_norm_eps=1e-5, rope_theta=1e4,
                 max_position_embeddings=64, tie_word_embeddings=True)


def qkv_delta(backend, slot: int, x: torch.Tensor) -> torch.Tensor:
    """LoRA delta of layer 1's q/k/v for tokens x, all served by `slot`."""
    y = torch.zeros(x.shape[0], SPEC.q_size + 2 * SPEC.kv_size)
    backend.prepare(torch.full((x.shape[0],), slot, dtype=torch.int32))
    backend.apply(1, "qkv", x, list(y.split([SPEC.q_size, SPEC.kv_size, SPEC.kv_size], dim=1)))
    return y


def test_views_are_built_off_the_step_and_follow_replacement(monkeypatch):
    builds: list[str] = []
    real = dense_backend.slot_views

    def recording(*args, **kwargs):
        builds.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(dense_backend, "slot_views", recording)
    slots = PagedAdapterSlots(SPEC, 8, torch.device("cpu"), torch.float32)
    slots.allocate_for(2)
    dense = lora_backend_for(slots, 16)
    dense.allocate()
    reference = lora_backend_for(slots, 16, "kernels")       # reads the pages through the row tables each call
    reference.allocate()
    x = torch.randn(5, SPEC.hidden_size)
    slot = slots.load("a", random_adapter(SPEC, 4, seed=1))
    assert len(builds) == 1 and builds[0] != threading.current_thread().name, builds
    first = qkv_delta(dense, slot, x)
    assert len(builds) == 1, "a step gathered adapter rows"
    assert torch.allclose(first, qkv_delta(reference, slot, x), atol=1e-5) and first.abs().max() > 0.1
    slot = slots.load("a", random_adapter(SPEC, 8, seed=2))  # same key, new weights (maybe the same slot)
    second = qkv_delta(dense, slot, x)
    assert len(builds) == 2
    assert torch.allclose(second, qkv_delta(reference, slot, x), atol=1e-5)
    assert not torch.allclose(first, second)
    assert dense.cached_slots == [slot]
    assert slots.evict("a") and dense.cached_slots == [], "an evicted adapter's copies stay in memory"


def test_rows_loaded_as_tensors_equal_the_converted_adapter():
    slots = PagedAdapterSlots(SPEC, 8, torch.device("cpu"), torch.float32)
    slots.allocate_for(2)
    dense = lora_backend_for(slots, 16)
    dense.allocate()
    adapter = random_adapter(SPEC, 4, seed=3)
    rows = [(r.module_id, r.layer_idx, r.rank, r.a, r.b) for r in adapter.rows()]
    x = torch.randn(3, SPEC.hidden_size)
    from_rows = qkv_delta(dense, slots.load_rows("rows", rows), x)
    from_adapter = qkv_delta(dense, slots.load("adapter", adapter), x)
    assert from_rows.abs().max() > 0.1 and torch.equal(from_rows, from_adapter)


def test_ranks_that_differ_between_layers_match_the_kernels_reference():
    """A module at rank 4 in layer 0 and 2 in layer 1, one absent from layer 1: each layer's copies are built
    on their own (same ranks in every layer build all layers at once); both equal the row-table path."""
    import numpy as np

    from loraplex.formats.adapter import Adapter

    full = random_adapter(SPEC, 4, seed=5)
    rows, cfg, in_out = [], [], []
    for r in full.rows():
        rank = r.rank if r.layer_idx == 0 else 2
        if r.layer_idx == 1 and r.module_id == 2:        # k_proj only in layer 0
            continue
        a, b = r.a[:rank], r.b[:, :rank]
        rows.append(torch.cat([a.flatten(), b.flatten()]))
        cfg.append([r.module_id, r.layer_idx, rank])
        in_out.append((a.shape[1], b.shape[0]))
    weights = torch.zeros(len(rows), max(x.numel() for x in rows))
    for i, x in enumerate(rows):
        weights[i, : x.numel()] = x
    adapter = Adapter(config=np.asarray(cfg, dtype=np.int32), weights=weights, in_out=tuple(in_out))
    slots = PagedAdapterSlots(SPEC, 8, torch.device("cpu"), torch.float32)
    slots.allocate_for(2)
    dense, reference = lora_backend_for(slots, 16), lora_backend_for(slots, 16, "kernels")
    dense.allocate()
    reference.allocate()
    slot = slots.load("mixed", adapter)
    x = torch.randn(3, SPEC.hidden_size)
    widths = {"qkv": [SPEC.q_size, SPEC.kv_size, SPEC.kv_size], "o": [SPEC.hidden_size],
              "gate_up": [SPEC.intermediate_size] * 2}
    for layer in range(SPEC.num_layers):
        for group, split in widths.items():
            got, want = (torch.zeros(3, sum(split)) for _ in range(2))
            for backend, y in ((dense, got), (reference, want)):
                backend.prepare(torch.full((3,), slot, dtype=torch.int32))
                backend.apply(layer, group, x, list(y.split(split, dim=1)))
            assert want.abs().max() > 0.01 and torch.allclose(got, want, atol=1e-5), (layer, group)
