"""The one adapter pool as the engine uses it: LRU eviction, pins, replacement, fused qkv rows, both backends."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compute_service.adapter_cache.backends import lora_backend_for
from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.engine import CapacityError, EngineConfig, LLMEngine, SamplingParams, load_model
from helpers import TINY_DIMS, rel_err
from loraplex.formats import Adapter


def make_adapter(rows: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> Adapter:
    """rows of (module_id, layer, A [r, in], B [out, r]) -> converted Adapter."""
    flats = [torch.cat([a.flatten(), b.flatten()]) for _, _, a, b in rows]
    w = torch.zeros(len(rows), max(f.numel() for f in flats))
    for i, f in enumerate(flats):
        w[i, : f.numel()] = f
    cfg = np.asarray([[m, layer, a.shape[0]] for m, layer, a, _ in rows], dtype=np.int32)
    return Adapter(config=cfg, weights=w)


def qkv_adapters(spec, rank: int, seed: int) -> tuple[Adapter, Adapter]:
    """The same LoRA written as fused qkv rows (id 0) and as separate q/k/v rows (ids 1-3)."""
    g = torch.Generator().manual_seed(seed)
    fused, split = [], []
    for layer in range(spec.num_layers):
        a = torch.randn(rank, spec.hidden_size, generator=g) * 0.2
        b = torch.randn(spec.q_size + 2 * spec.kv_size, rank, generator=g) * 0.2
        fused.append((0, layer, a, b))
        for mid, part in zip((1, 2, 3), b.split([spec.q_size, spec.kv_size, spec.kv_size])):
            split.append((mid, layer, a, part))
    return make_adapter(fused), make_adapter(split)


def full_adapter(spec, rank: int, seed: int) -> Adapter:
    """`rank` on all seven modules of every layer."""
    h, q, kv, i = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    feats = {1: (h, q), 2: (h, kv), 3: (h, kv), 4: (q, h), 5: (h, i), 6: (i, h), 7: (h, i)}
    g = torch.Generator().manual_seed(seed)
    return make_adapter([(m, layer, torch.randn(rank, fin, generator=g), torch.randn(fout, rank, generator=g))
                         for layer in range(spec.num_layers) for m, (fin, fout) in feats.items()])


def slots_of(kind: str, spec, max_slots: int):
    """The engine's own sizing of the pool, with the torch (CPU default) or the kernels backend."""
    s = PagedAdapterSlots(spec, 16, torch.device("cpu"), torch.float32)
    s.allocate_for(max_slots)
    backend = lora_backend_for(s, 256, kind)
    backend.allocate()
    return s, backend


def test_lru_eviction_pins_and_replacement(tiny_models):
    spec = load_model(tiny_models["llama"][1]).spec
    slots, _ = slots_of("torch", spec, 2)
    adapters = [qkv_adapters(spec, 4, seed)[1] for seed in range(3)]
    slots.load("a", adapters[0])
    slots.load("b", adapters[1])
    slots.slot_of("a")                      # a is now the most recently used
    slots.load("c", adapters[2])            # evicts b
    assert slots.resident("a") and slots.resident("c") and not slots.resident("b")
    slots.pin("a")
    slots.pin("c")
    with pytest.raises(CapacityError, match="pinned"):
        slots.load("b", adapters[1])
    with pytest.raises(CapacityError, match="pinned"):
        slots.load("a", adapters[1])        # a running request's adapter is never swapped under it
    assert not slots.evict("a")
    slots.unpin("a")
    assert slots.evict("a") and not slots.is_ready("a")
    assert slots.load("b", adapters[1]) in (0, 1)
    slots.unpin("c")
    assert sorted(slots.keys()) == ["b", "c"]
    slots.residency.check()


def test_loading_a_key_again_replaces_its_weights(tiny_models):
    loaded = load_model(tiny_models["llama"][1])
    slots, backend = slots_of("torch", loaded.spec, 2)
    engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"][1]), block_size=4), loaded=loaded,
                       slots=slots, lora_backend=backend)
    first, second = (qkv_adapters(loaded.spec, 4, seed)[1] for seed in (1, 2))
    prompt = list(range(3, 11))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def logits(key: str | None) -> torch.Tensor:
        engine.add_request(f"r{engine._arrivals}", prompt, params, key)
        rows = {}
        while engine.has_unfinished():
            rows.update(engine.step_with_logits()[1])
        return next(iter(rows.values()))

    engine.add_adapter("x", first)
    engine.add_adapter("y", second)
    want = logits("y")
    engine.add_adapter("x", second)          # the same key, new weights: the views of the slot are rebuilt
    assert rel_err(logits("x"), want) < 1e-6
    assert slots.stats().num_resident == 2


@pytest.mark.parametrize("kind", ["torch", "kernels"])
def test_fused_qkv_rows_equal_split_rows(tiny_models, kind):
    loaded = load_model(tiny_models["qwen2"][1])
    fused, split = qkv_adapters(loaded.spec, 6, seed=9)
    slots, backend = slots_of(kind, loaded.spec, 3)
    engine = LLMEngine(EngineConfig(model=str(tiny_models["qwen2"][1]), block_size=4), loaded=loaded,
                       slots=slots, lora_backend=backend)
    engine.add_adapter("fused", fused)
    engine.add_adapter("split", split)
    prompt = torch.randint(0, TINY_DIMS["vocab_size"], (10,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rows = {}
    for key in ("fused", "split", None):
        engine.add_request(str(key), prompt, params, key)
    while engine.has_unfinished():
        rows.update(engine.step_with_logits()[1])
    assert rel_err(rows["fused"], rows["split"]) < 1e-5
    assert rel_err(rows["fused"], rows["None"]) > 1e-2


def test_engine_default_is_the_pool_sized_for_max_loras(tiny_models):
    engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"][1]), max_loras=3, max_lora_rank=8))
    assert isinstance(engine.slots, PagedAdapterSlots) and engine.slots.max_slots == 3
    full = [full_adapter(engine.spec, 8, seed) for seed in range(3)]
    for i, a in enumerate(full):
        engine.add_adapter(f"k{i}", a)          # max_loras adapters of max rank fit together
    assert sorted(engine.slots.keys()) == ["k0", "k1", "k2"]
    assert type(engine.runner.lora).__name__ == "DenseLoraBackend"   # CPU: batched torch matmuls
