"""Paged-attention decode kernel vs its torch definition: GQA, block sizes, dtypes, scattered pages, graphs."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_decode
from kernels.paged_attention_ref import paged_attention_decode_ref


def _case(B, H, KVH, D, block_size, max_ctx, dtype, device, gen):
    """Random q, a NaN-poisoned cache whose used pages are scattered and random, tables and lengths."""
    ctx = torch.randint(1, max_ctx + 1, (B,), generator=gen)
    ctx[0] = max_ctx                                     # one sequence always at the maximum
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


def _check(B, H, KVH, D, block_size, max_ctx, dtype, device, tol, block_n=64):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, tables, lens = _case(B, H, KVH, D, block_size, max_ctx, dtype, device, gen)
    out = torch.full_like(q, float("nan"))
    scale = D ** -0.5
    paged_attention_decode(q, k, v, tables, lens, out, scale, block_n=block_n)
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
@pytest.mark.parametrize("B,max_ctx", [(1, 143), (8, 700), (64, 2100)])
def test_decode_llama8b_shapes_gpu(dtype, tol, B, max_ctx):
    _check(B=B, H=32, KVH=8, D=128, block_size=16, max_ctx=max_ctx, dtype=dtype, device="cuda", tol=tol)


@pytest.mark.gpu
def test_decode_graph_replay_follows_new_lengths():
    """Captured once; replays read the new tables and lengths written into the same tensors."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, tables, lens = _case(16, 32, 8, 128, 16, 300, torch.bfloat16, "cuda", gen)
    out = torch.empty_like(q)
    paged_attention_decode(q, k, v, tables, lens, out, 0.1)      # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_decode(q, k, v, tables, lens, out, 0.1)
    for _ in range(3):
        perm = torch.randperm(16, generator=gen).cuda()
        tables[:16] = tables[:16][perm].clone()                  # sequences swap page lists
        lens[:16] = lens[:16][perm].clone()
        lens[:16] = torch.minimum(lens[:16], torch.randint(1, 301, (16,), generator=gen).cuda().int())
        q.normal_()
        out.fill_(float("nan"))
        graph.replay()
        want = paged_attention_decode_ref(q, torch.nan_to_num(k), torch.nan_to_num(v), tables, lens, 0.1)
        assert torch.isfinite(out).all()
        assert (out.float() - want).abs().max() / want.abs().max() < 2e-2
