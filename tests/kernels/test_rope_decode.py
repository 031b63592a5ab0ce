"""RoPE + cache write + paged-attention decode in one launch against the two launches it replaces (RoPE + cache,
then the decode kernel): the same output and cache, bit for bit; split-K partials, a LoRA extra, split contexts,
grouped-query heads, a head dim that is not a power of two; the new token's stale slot is never read."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_decode
from kernels.paged_attention_ref import paged_attention_decode_ref
from kernels.rope_cache import rope_and_cache
from kernels.rope_decode import rope_attention_decode
from kernels.split_sum import SplitSum

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter runs only")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def _case(lens, H, KVH, D, block_size, dtype, device, gen, parts=0, extra=False):
    """Caches whose earlier keys/values are random, whose new-token slots and unused slots are NaN (never to be
    read), scattered pages; q/k/v rows (or partials) and an extra; RoPE tables."""
    B = len(lens)
    pages = [-(-n // block_size) for n in lens]
    num_blocks = sum(pages) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((B + 1, max(pages) + 1), 10**6, dtype=torch.int32)
    k = torch.full((num_blocks, block_size, KVH, D), float("nan"))
    v = torch.full_like(k, float("nan"))
    slots = []
    used = 0
    for b, n in enumerate(lens):
        ids = perm[used:used + pages[b]]
        used += pages[b]
        tables[b, :pages[b]] = ids.to(torch.int32)
        for p in range(n - 1):
            k[ids[p // block_size], p % block_size] = torch.randn(KVH, D, generator=gen)
            v[ids[p // block_size], p % block_size] = torch.randn(KVH, D, generator=gen)
        slots.append(int(ids[(n - 1) // block_size]) * block_size + (n - 1) % block_size)
    width = (H + 2 * KVH) * D
    if parts:
        qkv = SplitSum(torch.randn(parts, B, width, generator=gen).to(device), dtype)
    else:
        qkv = torch.randn(B, width, generator=gen).to(device=device, dtype=dtype)
    add = torch.randn(B, width, generator=gen).to(device=device, dtype=dtype) if extra else None
    max_pos = max(lens) + 4
    angles = torch.arange(max_pos)[:, None] * (1.0 / 100 ** (torch.arange(0, D, 2) / D))[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=1).to(device)
    sin = torch.cat([angles.sin(), angles.sin()], dim=1).to(device)
    positions = torch.tensor([n - 1 for n in lens] + [0], dtype=torch.int64, device=device)
    slot_mapping = torch.tensor(slots + [0], dtype=torch.int64, device=device)
    ctx = torch.tensor(lens + [1], dtype=torch.int32, device=device)
    caches = [t.to(device=device, dtype=dtype) for t in (k, v)]
    return qkv, add, positions, slot_mapping, cos, sin, caches, tables.to(device), ctx


def _run_both(lens, H, KVH, D, dtype, device, block_size=16, parts=0, extra=False, early=False, **split):
    gen = torch.Generator().manual_seed(sum(lens) * 31 + H * 7 + D + parts)
    qkv, add, pos, slots, cos, sin, (k, v), tables, ctx = _case(lens, H, KVH, D, block_size, dtype, device, gen,
                                                                   parts, extra)
    B = len(lens)
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    q = torch.empty(B, H, D, dtype=dtype, device=device)
    want = torch.full((B, H, D), float("nan"), dtype=dtype, device=device)
    rope_and_cache(qkv, pos, slots, cos, sin, q, k1, v1, add)
    paged_attention_decode(q, k1, v1, tables, ctx, want, D ** -0.5, block_n=16, **split)
    got = torch.full_like(want, float("nan"))
    rope_attention_decode(qkv, pos, slots, cos, sin, k2, v2, tables, ctx, got, D ** -0.5, add, block_n=16,
                          early=early, **split)
    return got, want, (k1, v1, k2, v2), (q, tables, ctx)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,KVH,D", [(4, 1, 16), (8, 2, 32), (6, 2, 80)])
@pytest.mark.parametrize("early", [False, True])
def test_matches_rope_then_decode(device, dtype, H, KVH, D, early):
    got, want, (k1, v1, k2, v2), _ = _run_both([1, 7, 16, 17, 40], H, KVH, D, dtype, device, early=early)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    assert torch.equal(k1.nan_to_num(123.0), k2.nan_to_num(123.0))      # the new tokens' k/v written, nothing else
    assert torch.equal(v1.nan_to_num(123.0), v2.nan_to_num(123.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("parts,extra", [(2, False), (3, True), (0, True)])
def test_partials_and_extra(device, parts, extra):
    got, want, (k1, v1, k2, v2), _ = _run_both([5, 33], 8, 2, 32, torch.bfloat16, device, parts=parts, extra=extra)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    assert torch.equal(k1.nan_to_num(123.0), k2.nan_to_num(123.0))
    assert torch.equal(v1.nan_to_num(123.0), v2.nan_to_num(123.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [2, 4])
@pytest.mark.parametrize("early", [False, True])
def test_split_context(device, num_splits, early):
    """Chunks of a split context: only the last one holds (and writes) the new token; every chunk reads the
    earlier keys, the first block before its wait."""
    got, want, (k1, v1, k2, v2), (q, tables, ctx) = _run_both([70, 3, 129], 8, 2, 32, torch.float32, device,
                                                              early=early, num_splits=num_splits,
                                                              min_split_context=16)
    assert torch.equal(got, want)
    assert torch.equal(k1.nan_to_num(123.0), k2.nan_to_num(123.0))
    ref = paged_attention_decode_ref(q, k1.nan_to_num(), v1.nan_to_num(), tables, ctx, 32 ** -0.5)
    assert (got - ref).abs().max() < 1e-4


def test_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(0)
    qkv, add, pos, slots, cos, sin, (k, v), tables, ctx = _case([3], 4, 2, 16, 16, torch.float32, "cpu", gen)
    out = torch.empty(1, 4, 16)
    with pytest.raises(ValueError, match="qkv must be"):
        rope_attention_decode(qkv[:, :-2], pos, slots, cos, sin, k, v, tables, ctx, out, 0.25)
    with pytest.raises(ValueError, match="share one dtype"):
        rope_attention_decode(qkv, pos, slots, cos, sin, k, v, tables, ctx, out.half(), 0.25)
    with pytest.raises(ValueError, match="block_n"):
        rope_attention_decode(qkv, pos, slots, cos, sin, k, v, tables, ctx, out, 0.25, block_n=24)
    with pytest.raises(ValueError, match="context_lens"):
        rope_attention_decode(qkv, pos, slots, cos, sin, k, v, tables, ctx.long(), out, 0.25)
