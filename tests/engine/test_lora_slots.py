"""Both adapter-slot implementations: LRU eviction, pins, fused qkv rows, and their backends agree."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compute_service.engine import CapacityError, EngineConfig, LLMEngine, SamplingParams, load_model
from compute_service.engine.lora_paged import KernelLoraBackend, PagedAdapterSlots
from compute_service.engine.lora_slots import InMemoryAdapterSlots
from compute_service.engine.lora_torch import TorchLoraBackend
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


def slots_of(kind: str, spec, max_slots: int):
    cpu = torch.device("cpu")
    if kind == "torch":
        s = InMemoryAdapterSlots(spec, max_slots, 16, cpu, torch.float32)
        return s, TorchLoraBackend(s)
    s = PagedAdapterSlots(spec, max_slots, 16, cpu, torch.float32)
    return s, KernelLoraBackend(s, 256)


@pytest.mark.parametrize("kind", ["torch", "paged"])
def test_lru_eviction_and_pins(tiny_models, kind):
    spec = load_model(tiny_models["llama"][1]).spec
    slots, _ = slots_of(kind, spec, 2)
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
    assert not slots.evict("a")
    slots.unpin("a")
    assert slots.evict("a") and not slots.is_ready("a")
    assert slots.load("b", adapters[1]) in (0, 1)


@pytest.mark.parametrize("kind", ["torch", "paged"])
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
