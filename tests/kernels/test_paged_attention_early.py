"""Decode attention with its first chunk read before the wait (`early`, LORAPLEX_ATTN_EARLY): the same attention
as the reference, split or not, and on a GPU the newest token's key and value as the launch just before wrote
them (read after the wait), not what the cache held before."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import EARLY_ENV, early_reads, paged_attention_decode
from kernels.paged_attention_ref import paged_attention_decode_ref
from test_paged_attention import _case, _check

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("H,KVH,D", [(4, 1, 16), (8, 2, 64), (6, 2, 80)])
def test_early_reads_match_the_reference(dtype, tol, H, KVH, D):
    # contexts of one token, under one chunk, exactly one chunk and a few chunks
    _check(B=4, H=H, KVH=KVH, D=D, block_size=16, max_ctx=70, dtype=dtype, device=DEVICE, tol=tol, block_n=32,
           lens_to=[70, 1, 20, 32], early=True)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_early_reads_of_split_launches(num_splits):
    _check(B=5, H=8, KVH=2, D=64, block_size=16, max_ctx=150, dtype=torch.float32, device=DEVICE, tol=1e-4,
           block_n=16, num_splits=num_splits, lens_to=[150, 1, 15, 16, 33], min_split_context=0, early=True)


def test_the_switch(monkeypatch):
    monkeypatch.delenv(EARLY_ENV, raising=False)
    assert not early_reads()                          # off until measured
    monkeypatch.setenv(EARLY_ENV, "1")
    assert early_reads()
    monkeypatch.setenv(EARLY_ENV, "2")
    with pytest.raises(ValueError, match=EARLY_ENV):
        early_reads()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("max_ctx", [40, 64, 143])
def test_gpu_the_newest_row_comes_from_the_launch_before(max_ctx):
    """Each sequence's newest key and value are NaN in the cache until a launch just before the attention (a
    dependent launch: RoPE + cache, as in a decode step) writes them; with early reads the attention is still
    the reference's of the written rows (a NaN read before the wait would poison the output)."""
    from kernels.rope_cache import rope_and_cache

    gen = torch.Generator().manual_seed(max_ctx)
    B, H, KVH, D, bs = 3, 32, 8, 128, 16
    q, k, v, tables, lens = _case(B, H, KVH, D, bs, max_ctx, torch.bfloat16, DEVICE, gen)
    n = [int(x) for x in lens[:B].tolist()]
    slots = torch.tensor([int(tables[b, (c - 1) // bs]) * bs + (c - 1) % bs for b, c in enumerate(n)], device=DEVICE)
    k.view(-1, KVH, D)[slots] = float("nan")
    v.view(-1, KVH, D)[slots] = float("nan")
    qkv = torch.randn(B, (H + 2 * KVH) * D, generator=gen).to(DEVICE, torch.bfloat16)
    pos = torch.tensor(n, device=DEVICE) - 1
    ang = torch.zeros(max_ctx, D, device=DEVICE)            # no rotation: q, k as given
    q_out = torch.empty(B, H, D, dtype=torch.bfloat16, device=DEVICE)
    out = torch.full_like(q_out, float("nan"))

    def step():
        rope_and_cache(qkv, pos, slots, ang.cos().contiguous(), ang.sin().contiguous(), q_out, k, v)
        paged_attention_decode(q_out, k, v, tables, lens, out, D ** -0.5, early=True)
    step()
    torch.cuda.synchronize()
    want = paged_attention_decode_ref(q_out, torch.nan_to_num(k), torch.nan_to_num(v), tables, lens, D ** -0.5)
    assert torch.isfinite(out).all()
    assert (out.float() - want).abs().max() / want.abs().max() < 2e-2
