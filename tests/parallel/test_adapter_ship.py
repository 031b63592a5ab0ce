"""Announced adapters: rank 0 writes one file linked per follower; a follower stages its copy on its
prefetch thread and installs it into a real pool; no file is left behind."""
from __future__ import annotations

import glob

import pytest
import torch

from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.engine.spec import ModelSpec
from compute_service.parallel.adapter_ship import AdapterMailer, Prefetcher, follower_path
from tp_helpers import random_adapter


def _spec() -> ModelSpec:
    return ModelSpec(architecture="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=64, vocab_size=100, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=128, tie_word_embeddings=True)


def test_announced_adapter_is_staged_and_installed_and_its_files_removed():
    spec = _spec()
    slots = PagedAdapterSlots(spec, 16, torch.device("cpu"), torch.float32)
    slots.allocate_for(2)
    mailer = AdapterMailer(world=3)                       # two followers: two links
    adapter = random_adapter(spec, (1, 2, 3, 4, 5, 6, 7), 8, seed=1)
    base = mailer.write(adapter)
    assert sorted(glob.glob(base + "*")) == [follower_path(base, 1), follower_path(base, 2)]
    pre = Prefetcher(slots, rank=1)
    try:
        pre.announce("a", base)
        assert not glob.glob(follower_path(base, 1))      # opened and unlinked at once
        slot = slots.load_staged("a", pre.take("a"))
        assert slots.resident("a") and slots.slot_of("a") == slot
        with pytest.raises(KeyError):
            pre.take("a")                                 # taken once
    finally:
        pre.close()
    mailer.close()                                        # rank 0 removes what follower 2 never read
    assert not glob.glob(mailer.prefix + "*")
