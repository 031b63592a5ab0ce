"""The paged LoRA backend against the engine's torch backend on the same adapters and tokens."""
from __future__ import annotations

import pytest
import torch
from compute_helpers import random_adapter

from compute_service.adapter_cache.paged_backend import PagedLoraBackend
from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.engine.lora_slots import InMemoryAdapterSlots
from compute_service.engine.lora_torch import TorchLoraBackend
from compute_service.engine.spec import ModelSpec

SPEC = ModelSpec(architecture="llama", num_layers=2, hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=16,
                 intermediate_size=160, vocab_size=50, rms_norm_eps=1e-5, rope_theta=1e4,
                 max_position_embeddings=64, tie_word_embeddings=True)
GROUPS = {"qkv": [96, 32, 32], "o": [96], "gate_up": [160, 160], "down": [96]}
IN = {"qkv": 96, "o": 96, "gate_up": 96, "down": 160}


@pytest.mark.parametrize("device,dtype,tol", [
    ("cpu", torch.float32, 1e-5),
    pytest.param("cuda", torch.float32, 5e-3, marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, 3e-2, marks=pytest.mark.gpu),
])
def test_paged_backend_equals_torch_backend(device, dtype, tol):
    gen = torch.Generator().manual_seed(int(torch.seed() % 2**31))
    dev = torch.device(device)
    paged = PagedAdapterSlots(SPEC, 64, dev, dtype)
    paged.allocate(4 << 20, optimal_adapter_size=4)
    dense = InMemoryAdapterSlots(SPEC, 8, 64, dev, dtype)
    # Mixed ranks and partial module sets; loads interleaved with an eviction so slots and pages get reused.
    specs = [(8, (1, 2, 3, 4, 5, 6, 7)), (64, (1, 3, 6)), (1, (0, 5, 7)), (17, (1, 2, 3, 4, 5, 6, 7))]
    for i, (rank, mods) in enumerate(specs):
        a = random_adapter(SPEC, rank, seed=int(torch.randint(0, 10**6, (1,), generator=gen)), modules=mods,
                           scale=1.0)
        paged.load(f"a{i}", a)
        dense.load(f"a{i}", a)
        if i == 1:
            paged.load("tmp", random_adapter(SPEC, 4, seed=5))
            assert paged.evict("tmp")
    T = 37
    choices = torch.tensor([-1] + [paged.slot_of(f"a{i}") for i in range(4)])
    keys = torch.randint(0, 5, (T,), generator=gen)
    paged_ids = choices[keys].to(torch.int32)
    dense_ids = torch.tensor([-1] + [dense.slot_of(f"a{i}") for i in range(4)])[keys].to(torch.int32)
    # Tokens of one adapter are contiguous in the engine's batch, but the backends must not rely on it.
    pb, tb = PagedLoraBackend(paged, 64), TorchLoraBackend(dense)
    pb.prepare(paged_ids)
    tb.prepare(dense_ids)
    for layer in range(SPEC.num_layers):
        for group, outs in GROUPS.items():
            x = torch.randn(T, IN[group], generator=gen).to(dev, dtype)
            base = torch.randn(T, sum(outs), generator=gen).to(dev, dtype)
            got, want = base.clone(), base.clone()
            pb.apply(layer, group, x, list(got.split(outs, dim=1)))
            tb.apply(layer, group, x, list(want.split(outs, dim=1)))
            scale = (want - base).float().abs().max().item()
            assert scale > 0.1, "adapters must change the output"
            err = (got.float() - want.float()).abs().max().item()
            assert err <= tol * max(1.0, scale), f"layer {layer} {group}: max err {err} (delta scale {scale})"
            untouched = keys == 0
            assert torch.equal(got[untouched.to(dev)], base[untouched.to(dev)]), "tokens without adapter changed"


def test_nan_or_misshaped_adapter_refused_naming_the_problem():
    from compute_service.engine.errors import InvalidAdapterError
    slots = PagedAdapterSlots(SPEC, 16, torch.device("cpu"), torch.float32)
    slots.allocate(1 << 20)
    bad = random_adapter(SPEC, 4, seed=3)
    bad.weights[5, 7] = float("nan")
    with pytest.raises(InvalidAdapterError, match="NaN or Inf"):
        slots.load("nan", bad)
    with pytest.raises(InvalidAdapterError, match=r"row 0 .*rank must be in \[1, max_lora_rank=16\]"):
        slots.load("big", random_adapter(SPEC, 32, seed=4))
    assert slots.stats().pages_used == 0 and not slots.resident("nan")
