"""The seed's worked example: 4 layers, hidden 4, q rank 2, k rank 4, last two layers q only,
the last with rank 8. It converts to every format and back, rows intact."""
from __future__ import annotations

import pytest
import torch

from formats_helpers import SEED_CONFIG, SEED_SPEC, seed_tensors
from loraplex.formats import adapter_from_tensors, load_adapter, save_adapter, validate

@pytest.fixture
def seed():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    return seed_tensors(gen)


def test_row_widths_follow_the_seed(seed):
    config, weights, _ = seed
    adapter = validate(adapter_from_tensors(weights, config), SEED_SPEC, max_lora_rank=8)
    # rank 2 rows use 2x4 + 4x2 = 16 values, rank 4 rows 32, the rank 8 row the full 64
    used = [r * sum(io) for (_, _, r), io in zip(SEED_CONFIG, adapter.in_out)]
    assert used == [16, 32, 16, 32, 16, 64]
    assert adapter.weights.shape == (6, 64)


@pytest.mark.parametrize("fmt,name", [("npy", "npy"), ("safetensors", "x.safetensors"), ("peft", "peft")])
def test_seed_converts_both_ways(seed, tmp_path, fmt, name):
    config, weights, pairs = seed
    adapter = validate(adapter_from_tensors(weights, config), SEED_SPEC, max_lora_rank=8)
    save_adapter(adapter, tmp_path / name, fmt)
    back = validate(load_adapter(tmp_path / name), SEED_SPEC, max_lora_rank=8)
    rows = {(r.module_id, r.layer_idx): r for r in back.rows()}
    assert sorted(rows) == sorted((m, l) for m, l, _ in SEED_CONFIG)  # PEFT reorders (documented)
    for (m, l, rank), (a, b) in zip(SEED_CONFIG, pairs):
        assert rows[(m, l)].rank == rank
        assert torch.equal(rows[(m, l)].a, a) and torch.equal(rows[(m, l)].b, b)
    if fmt != "peft":
        assert back.content_hash == adapter.content_hash  # same rows, same order


def test_seed_peft_names(seed, tmp_path):
    from safetensors import safe_open

    config, weights, _ = seed
    save_adapter(validate(adapter_from_tensors(weights, config), SEED_SPEC, 8), tmp_path / "p", "peft")
    with safe_open(str(tmp_path / "p" / "adapter_model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"] == (8, 4)
    assert shapes["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"] == (4, 4)
    assert len(shapes) == 12
