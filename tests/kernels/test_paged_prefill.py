"""Paged prefill/mixed attention kernel vs its torch definition: decodes beside prompt chunks, chunks that
continue a context, GQA groups, block sizes, dtypes, scattered pages; and the engine's metadata for it."""
from __future__ import annotations

import pytest
import torch

from compute_service.engine.attention import AttentionMetadata, PrefillMetadata, paged_attention
from kernels.paged_attention_ref import paged_attention_prefill_ref
from kernels.paged_prefill import TILE_TOKENS, paged_attention_prefill, prefill_tiles


def _case(query_lens, context_lens, H, KVH, D, block_size, dtype, device, gen):
    """Random q and a NaN-poisoned cache whose used pages are scattered; slots past a context stay NaN."""
    pages = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(pages), max(pages) + 1), 10**6, dtype=torch.int32)   # junk past the pages
    k = torch.full((num_blocks, block_size, KVH, D), float("nan"))
    v = torch.full((num_blocks, block_size, KVH, D), float("nan"))
    used = 0
    table_lists = []
    for b, n in enumerate(pages):
        ids = perm[used:used + n]
        used += n
        tables[b, :n] = ids.to(torch.int32)
        table_lists.append(ids.tolist())
        k[ids] = torch.randn(n, block_size, KVH, D, generator=gen)
        v[ids] = torch.randn(n, block_size, KVH, D, generator=gen)
        last = context_lens[b] - (n - 1) * block_size
        k[ids[-1], last:] = float("nan")
        v[ids[-1], last:] = float("nan")
    q = torch.randn(sum(query_lens), H, D, generator=gen)
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    return q, k, v, tables.to(device), table_lists


def _check(query_lens, context_lens, H, KVH, D, block_size, dtype, device, tol, block_n=32):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, tables, _ = _case(query_lens, context_lens, H, KVH, D, block_size, dtype, device, gen)
    tiles = torch.tensor(prefill_tiles(query_lens, context_lens), dtype=torch.int32, device=device).view(-1, 4)
    out = torch.full_like(q, float("nan"))
    scale = D ** -0.5
    paged_attention_prefill(q, k, v, tables, tiles, out, scale, block_n=block_n)
    want = paged_attention_prefill_ref(q, torch.nan_to_num(k), torch.nan_to_num(v), tables, query_lens,
                                       context_lens, scale)
    assert torch.isfinite(out).all()
    err = (out.float() - want).abs().max() / want.abs().max()
    assert err < tol, err


def test_tiles_cover_every_token_once():
    tiles = prefill_tiles([1, 40, 3], [9, 40, 20])
    rows = [(r0 + i, p0 + i, b) for r0, n, p0, b in zip(*[iter(tiles)] * 4) for i in range(n)]
    assert [r for r, _, _ in rows] == list(range(44))
    assert rows[0] == (0, 8, 0)                          # the decode: its one token at position 8
    assert [p for _, p, b in rows if b == 1] == list(range(40))
    assert [p for _, p, b in rows if b == 2] == [17, 18, 19]
    assert max(n for n in tiles[1::4]) <= TILE_TOKENS


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("H,KVH,D", [(4, 1, 16), (4, 4, 32), (9, 3, 64), (6, 2, 80)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_step_matches_reference_small(dtype, tol, H, KVH, D, block_size):
    """Two decodes, a fresh prompt longer than a tile, a chunk that continues a context: the interpreter on
    CPU, the real kernel where a GPU is present."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check([1, 21, 1, 5], [37, 21, 3, 50], H, KVH, D, block_size, dtype, device, tol)


def test_rejects_bad_inputs():
    q = torch.randn(3, 4, 16)
    k = torch.randn(4, 16, 2, 16)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    tiles = torch.tensor([[0, 3, 0, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_prefill(q, k, k.clone(), tables.long(), tiles, torch.empty_like(q), 0.25)
    with pytest.raises(ValueError, match="tiles"):
        paged_attention_prefill(q, k, k.clone(), tables, tiles.long(), torch.empty_like(q), 0.25)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_prefill(torch.randn(3, 3, 16), k, k.clone(), tables, tiles, torch.empty(3, 3, 16), 0.25)
    with pytest.raises(ValueError, match="at most"):
        one = torch.randn(4, 16, 1, 16)
        paged_attention_prefill(torch.randn(3, 34, 16), one, one.clone(), tables, tiles, torch.empty(3, 34, 16), 0.25)


def test_engine_metadata_matches_padded_tiles():
    """The engine's two prefill paths agree: `PrefillMetadata` + the kernel against the padded-tile
    `AttentionMetadata` + SDPA reference, K/V written through `paged_attention` in both."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(3)
    query_lens, context_lens, bs = [1, 19, 4, 1], [30, 19, 21, 2], 16
    q, k_cache, v_cache, _, tables = _case(query_lens, context_lens, 8, 2, 32, bs, torch.float32, device, gen)
    k_cache, v_cache = torch.nan_to_num(k_cache), torch.nan_to_num(v_cache)
    T = sum(query_lens)
    k_new, v_new = (torch.randn(T, 2, 32, generator=gen).to(device) for _ in range(2))
    outs = []
    for build in (AttentionMetadata.build, PrefillMetadata.build):
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = build(query_lens, context_lens, tables, bs, device)
        outs.append((paged_attention(q, k_new, v_new, kc, vc, meta, 0.2), kc))
    (ref, kc_ref), (got, kc_got) = outs
    assert torch.equal(kc_ref, kc_got)                  # the same slots written
    assert (got - ref).abs().max() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3), (torch.float32, 1e-4)])
@pytest.mark.parametrize("H,KVH", [(32, 8), (9, 3), (64, 8)])
def test_llama_shapes_gpu(dtype, tol, H, KVH):
    """64 decodes beside a 700-token prompt and a 300-token chunk of a 2100-token context."""
    query_lens = [1] * 64 + [700, 300]
    gen = torch.Generator().manual_seed(0)
    context_lens = torch.randint(1, 1500, (64,), generator=gen).tolist() + [700, 2100]
    _check(query_lens, context_lens, H, KVH, 128 if H != 9 else 64, 16, dtype, "cuda", tol, block_n=64)
