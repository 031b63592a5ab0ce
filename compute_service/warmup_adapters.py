"""Synthetic adapters for the start-up warm-up: resident while it runs, gone (with their traces) after.

The kernels specialise on the pool's largest rank (fixed at start), not on an
adapter's; two ranks (8 and 64, or the pool's largest if smaller) on every
module of every layer give the warm-up steps a partial and a full rank block
and batches with two adapters (two segments). The larger is skipped when the
pool cannot hold both. They load through the pool's ordinary path (`load`), as
a user's adapter would.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from compute_service.adapter_cache.layout import module_features
from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from kernels import pages_needed
from loraplex.formats.adapter import Adapter

log = logging.getLogger(__name__)
KEY_PREFIX = "__warmup__/rank"
SMALL_RANK = 8
LARGE_RANK = 64


def synthetic_ranks(slots: PagedAdapterSlots) -> list[int]:
    """Ranks the pool can hold at once (the small one always, when any adapter fits at all)."""
    assert slots.layout is not None
    top = slots.layout.max_rank
    feats = list(module_features(slots.spec).values())
    layers = slots.spec.num_layers
    ranks, used = [], 0
    for rank in sorted({min(SMALL_RANK, top), min(LARGE_RANK, top)}):
        need = pages_needed([(rank, fin, fout) for fin, fout in feats] * layers, slots.layout.page_elems)
        if used + need <= slots.layout.num_pages and len(ranks) < slots.max_slots:
            ranks.append(rank)
            used += need
    return ranks


def synthetic_adapter(slots: PagedAdapterSlots, rank: int, seed: int) -> Adapter:
    """Random A and B of `rank` for modules 1-7 of every layer (one draw per module, reused over layers)."""
    gen = torch.Generator().manual_seed(seed)
    feats = module_features(slots.spec)
    per_module = {m: torch.cat([(torch.randn(rank, fin, generator=gen) * fin ** -0.5).flatten(),
                                (torch.randn(fout, rank, generator=gen) * 0.01).flatten()])
                  for m, (fin, fout) in feats.items()}
    width = max(v.numel() for v in per_module.values())
    order = [(layer, m) for layer in range(slots.spec.num_layers) for m in feats]
    # One row per module, then one repeat over the layers: a few host ops, not one per row (at start-up the
    # host's cores are busy with the other services' imports, and every multi-threaded op waits for them:
    # one copy per row took 3.8 s inside `loraplex serve` on a 16-core H200 host, 0.02 s alone).
    rows = torch.zeros(len(feats), width, dtype=slots.dtype)
    for j, v in enumerate(per_module.values()):
        rows[j, : v.numel()] = v
    weights = rows.repeat(slots.spec.num_layers, 1)
    config = np.asarray([[m, layer, rank] for layer, m in order], dtype=np.int32)
    return Adapter(config=config, weights=weights, in_out=tuple(feats[m] for _, m in order))


def load_synthetic(slots: PagedAdapterSlots, seed: int = 0) -> list[tuple[str, int]]:
    """Loads one random adapter per rank of `synthetic_ranks`; returns [(key, rank)]."""
    keys = []
    fingerprint, slots.fingerprint = slots.fingerprint, None     # built here, for this very model
    try:
        for rank in synthetic_ranks(slots):
            key = f"{KEY_PREFIX}{rank}"
            slots.load(key, synthetic_adapter(slots, rank, seed + rank))
            keys.append((key, rank))
    finally:
        slots.fingerprint = fingerprint
    if not keys:
        log.warning("warm-up: the adapter pool holds no adapter of rank %d; LoRA kernels compile on first use",
                    SMALL_RANK)
    return keys


def unload_synthetic(slots: PagedAdapterSlots, keys: list[tuple[str, int]]) -> None:
    """Evicts the synthetic adapters and forgets them: the pool's pages and counters are as before."""
    res = slots.residency
    assert res is not None
    evictions = res.num_evictions
    for key, _ in keys:
        if not slots.evict(key):
            raise RuntimeError(f"warm-up adapter {key} is still in use")
        slots.timings.pop(key, None)
    res.num_evictions = evictions
