"""Paged-attention decode kernel vs its torch definition: GQA, block sizes, dtypes, scattered pages, graphs,
the context split over several programs a (sequence, KV head)."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_decode
from kernels.paged_attention_ref import paged_attention_decode_ref
from kernels import paged_split
from kernels.paged_split import decode_splits


def _case(B, H, KVH, D, block_size, max_ctx, dtype, device, gen, lens_to=None):
    """Random q, a NaN-poisoned cache whose used pages are scattered and random, tables and lengths (random,
    the first at max_ctx; or `lens_to`)."""
    ctx = torch.randint(1, max_ctx + 1, (B,), generator=gen)
    ctx[0] = max_ctx                                     # one sequence always at the maximum
    if lens_to is not None:
        ctx = torch.tensor(lens_to)
    pages = [-(-int(n) // block_size) for n in ctx]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    max_pages = max(pages) + 1
    tables = torch.full((B + 2, max_pages), 10**6, dtype=torch.int32)   # junk past each sequence's pages
    k = torch.full((num_blocks, block_size, KVH, D), float("nan"))
    v = torch.full((num_blocks, block_size, KVH, D), float("nan"))
    used = 0
    for b, n in enumerate(pages):
        ids = perm[used:used + n]
        used += n
        tables[b, :n] = ids.to(torch.int32)
        k[ids] = torch.randn(n, block_size, KVH, D, generator=gen)
        v[ids] = torch.randn(n, block_size, KVH, D, generator=gen)
        # Slots past the context inside the last page stay NaN: they must never be read.
        last = int(ctx[b]) - (n - 1) * block_size
        k[ids[-1], last:] = float("nan")
        v[ids[-1], last:] = float("nan")
    q = torch.randn(B, H, D, generator=gen)
    lens = torch.cat([ctx, torch.ones(2, dtype=torch.int64)]).to(torch.int32)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)] + [tables.to(device), lens.to(device)]


def _check(B, H, KVH, D, block_size, max_ctx, dtype, device, tol, block_n=64, num_splits=None, lens_to=None,
           **split):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, tables, lens = _case(B, H, KVH, D, block_size, max_ctx, dtype, device, gen, lens_to)
    out = torch.full_like(q, float("nan"))
    scale = D ** -0.5
    paged_attention_decode(q, k, v, tables, lens, out, scale, block_n=block_n, num_splits=num_splits, **split)
    want = paged_attention_decode_ref(q, torch.nan_to_num(k), torch.nan_to_num(v), tables, lens, scale)
    err = (out.float() - want).abs().max() / want.abs().max()
    assert torch.isfinite(out).all()
    assert err < tol, err


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("H,KVH,D", [(4, 1, 16), (4, 4, 32), (8, 2, 64), (6, 2, 80)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference_small(dtype, tol, H, KVH, D, block_size):
    """Small shapes: the interpreter on CPU, the real kernel where a GPU is present."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check(B=3, H=H, KVH=KVH, D=D, block_size=block_size, max_ctx=70, dtype=dtype, device=device, tol=tol,
           block_n=32)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("H,KVH,D", [(4, 1, 16), (8, 2, 64), (6, 2, 80), (4, 4, 32)])
def test_split_context_matches_reference(num_splits, H, KVH, D):
    """Split launches: contexts of one token, under one block, one chunk, a few chunks and past the splits'
    even share (empty trailing chunks); every counter back at zero afterwards."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check(B=5, H=H, KVH=KVH, D=D, block_size=16, max_ctx=150, dtype=torch.float32, device=device, tol=1e-4,
           block_n=16, num_splits=num_splits, lens_to=[150, 1, 15, 16, 33], min_split_context=0)
    assert paged_split._counters and not any(c.any() for c in paged_split._counters.values())


def test_split_bf16_matches_reference():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check(B=2, H=8, KVH=2, D=32, block_size=16, max_ctx=200, dtype=torch.bfloat16, device=device, tol=2e-2,
           block_n=32, num_splits=4, min_split_context=0)


def test_split_leaves_short_contexts_whole():
    """Contexts either side of MIN_SPLIT_CONTEXT in one split launch (up to it one chunk, past it split)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    edge = paged_split.MIN_SPLIT_CONTEXT
    _check(B=4, H=4, KVH=2, D=16, block_size=16, max_ctx=edge + 44, dtype=torch.float32, device=device, tol=1e-4,
           num_splits=4, lens_to=[edge + 44, edge, edge + 1, 40])


def test_decode_splits_rule():
    """About SPLIT_WAVES waves of programs, none past the tables' width or the merge's rows."""
    assert paged_split.SPLIT_WAVES == 3                              # the figures below are for 3 waves
    assert decode_splits(1, 8, 4, 32768, 64, 132) == 16             # 8B at batch 1: MAX_SPLITS
    assert decode_splits(4, 8, 4, 32768, 64, 132) == 13             # 32 pairs: ceil(3 * 132 / 32)
    assert decode_splits(8, 8, 4, 32768, 64, 132) == 7
    assert decode_splits(32, 8, 4, 32768, 64, 132) == 2
    assert decode_splits(50, 8, 4, 32768, 64, 132) == 1             # 400 pairs: three waves alone, unsplit
    assert decode_splits(1, 8, 4, 1000, 64, 132) == 16
    assert decode_splits(1, 8, 4, 300, 64, 132) == 5                # a context of at most five blocks
    assert decode_splits(1, 8, 4, paged_split.MIN_SPLIT_CONTEXT, 64, 132) == 1    # too short to split
    assert decode_splits(1, 1, 32, 32768, 64, 132) == 2             # 32 query heads a KV head: 64 merge rows
    assert decode_splits(1, 3, 3, 32768, 64, 132) == 16             # the default model's 3 KV heads
    assert [paged_split.max_splits(g) for g in (1, 4, 5, 8, 32)] == [16, 16, 8, 8, 2]


def test_rejects_more_splits_than_the_merge_takes():
    q = torch.randn(1, 32, 16)
    k = torch.randn(4, 16, 1, 16)
    tables = torch.zeros(1, 4, dtype=torch.int32)
    lens = torch.full((1,), 60, dtype=torch.int32)
    with pytest.raises(ValueError, match="at most 2"):
        paged_attention_decode(q, k, k.clone(), tables, lens, torch.empty_like(q), 0.25, num_splits=3)


def test_rejects_bad_inputs():
    q = torch.randn(2, 4, 16)
    k = torch.randn(4, 16, 2, 16)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_decode(q, k, k.clone(), tables.long(), lens, torch.empty_like(q), 0.25)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_decode(torch.randn(2, 3, 16), k, k.clone(), tables, lens, torch.empty(2, 3, 16), 0.25)
    with pytest.raises(ValueError, match="share"):
        paged_attention_decode(q, k.half(), k.half(), tables, lens, torch.empty_like(q), 0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3), (torch.float32, 1e-4)])
@pytest.mark.parametrize("B,max_ctx", [(1, 143), (1, 5000), (2, 3000), (8, 700), (64, 2100)])
def test_decode_llama8b_shapes_gpu(dtype, tol, B, max_ctx):
    _check(B=B, H=32, KVH=8, D=128, block_size=16, max_ctx=max_ctx, dtype=dtype, device="cuda", tol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [16, 2])
def test_decode_graph_replay_follows_new_lengths(B):
    """Captured once; replays read the new tables and lengths written into the same tensors (at 2 sequences
    the context is split: each replay's chunks follow its lengths)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, tables, lens = _case(B, 32, 8, 128, 16, 300, torch.bfloat16, "cuda", gen)
    out = torch.empty_like(q)
    paged_attention_decode(q, k, v, tables, lens, out, 0.1)      # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_decode(q, k, v, tables, lens, out, 0.1)
    for _ in range(3):
        perm = torch.randperm(B, generator=gen).cuda()
        tables[:B] = tables[:B][perm].clone()                    # sequences swap page lists
        lens[:B] = lens[:B][perm].clone()
        lens[:B] = torch.minimum(lens[:B], torch.randint(1, 301, (B,), generator=gen).cuda().int())
        q.normal_()
        out.fill_(float("nan"))
        graph.replay()
        want = paged_attention_decode_ref(q, torch.nan_to_num(k), torch.nan_to_num(v), tables, lens, 0.1)
        assert torch.isfinite(out).all()
        assert (out.float() - want).abs().max() / want.abs().max() < 2e-2


@pytest.mark.gpu
def test_capture_before_any_split_launch_runs_unsplit(monkeypatch):
    """A graph captured before the device's counters exist launches unsplit (a buffer made inside the capture
    would be zeroed only by replays) and still attends correctly."""
    monkeypatch.setattr(paged_split, "_counters", {})
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, tables, lens = _case(1, 32, 8, 128, 16, 700, torch.bfloat16, "cuda", gen)
    out = torch.full_like(q, float("nan"))
    paged_attention_decode(q, k, v, tables, lens, out, 0.1, num_splits=1)   # compile outside the capture
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_decode(q, k, v, tables, lens, out, 0.1)
    graph.replay()
    assert paged_split._counters == {}
    want = paged_attention_decode_ref(q, torch.nan_to_num(k), torch.nan_to_num(v), tables, lens, 0.1)
    assert (out.float() - want).abs().max() / want.abs().max() < 2e-2
