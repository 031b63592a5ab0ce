"""The decode graphs' host staging: token ids, positions, KV slots, context lengths and block tables of a
step, padding rows pointing at the scratch block. Runs on the CPU (the buffers the graph reads are plain
tensors here), so the arithmetic is checked where there is no GPU."""
from __future__ import annotations

import random

import torch

from compute_service.engine.cuda_graphs import DecodeGraphs


def staging(max_batch: int, max_blocks: int, block_size: int, scratch: int) -> DecodeGraphs:
    g = object.__new__(DecodeGraphs)       # the buffers only: no model, no CUDA graph pool
    g.block_size, g.scratch_block = block_size, scratch
    g._allocate_inputs(torch.device("cpu"), max_batch, max_blocks)
    g._staged = None
    return g


def test_one_copy_carries_every_input():
    """The buffers the graphs read are views of one device allocation laid out as the host staging."""
    g = staging(16, 4, 16, 7)
    g._fill([5, 6], [3, 20], [[1], [2, 3]], 2)
    assert g.input_ids.data_ptr() == g._dev.data_ptr()
    assert g.meta.block_tables.data_ptr() == g._dev.data_ptr() + g._tables_off
    assert g.meta.context_lens.tolist()[:3] == [4, 21, 1] and g.meta.block_tables[1, :2].tolist() == [2, 3]
    assert g.meta.slot_mapping[:2].tolist() == [1 * 16 + 3, 3 * 16 + 4]


def test_fill_writes_each_row_and_pads_the_bucket():
    rng = random.Random(0)
    bs, scratch = 16, 99
    g = staging(32, 8, bs, scratch)
    for n, bucket in ((5, 8), (16, 16), (1, 1), (0, 4)):
        tables = [rng.sample(range(90), rng.randint(1, 8)) for _ in range(n)]
        positions = [rng.randrange(len(t) * bs) for t in tables]
        ids = [rng.randrange(1000) for _ in range(n)]
        g._fill(ids, positions, tables, bucket)
        assert g.input_ids[:n].tolist() == ids and g.positions[:n].tolist() == positions
        assert g.meta.slot_mapping[:n].tolist() == [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        assert g.meta.context_lens[:n].tolist() == [p + 1 for p in positions]
        for b, t in enumerate(tables):
            assert g.meta.block_tables[b, :len(t)].tolist() == t
        pad = slice(n, bucket)
        assert g.input_ids[pad].eq(0).all() and g.positions[pad].eq(0).all()
        assert g.meta.slot_mapping[pad].eq(scratch * bs).all() and g.meta.context_lens[pad].eq(1).all()
        assert g.meta.block_tables[pad, 0].eq(scratch).all()


def test_pending_tokens_land_in_their_rows():
    """The step in flight's tokens go to the rows that wait for them: in place (same rows, same order) or
    through an index (sequences finished or joined in between); other rows keep their host ids."""
    from compute_service.engine.pending import PendingTokens, fill_pending

    tokens = torch.tensor([70, 71, 72, 73, 74])
    ids = torch.tensor([0, 0, 0, 9, 0])
    same = PendingTokens([0, 1, 2], [0, 1, 2], tokens)
    assert same.in_place
    fill_pending(ids, same)
    assert ids.tolist() == [70, 71, 72, 9, 0]
    ids = torch.tensor([5, 0, 0, 0, 6])
    moved = PendingTokens([1, 2, 3], [4, 0, 2], tokens)
    assert not moved.in_place
    fill_pending(ids, moved)
    assert ids.tolist() == [5, 74, 70, 72, 6]
