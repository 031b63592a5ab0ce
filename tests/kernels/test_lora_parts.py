"""A one-token LoRA with no launch of its own (`kernels.lora_parts`): the one-row quantized kernel's extra programs
store the shrink's partial products a K split each, and RoPE + cache adds the q, k and v deltas from them.

CPU: Triton's interpreter, small shapes; `gpu`: the compiled kernels on an 8B-like q/k/v.
"""
from __future__ import annotations

import pytest
import torch

from kernels.lora_parts import LoraParts, parts_buffer, reference_delta
from kernels.quant_dequant import dequantize_packed
from kernels.quant_matmul import QuantMatmulConfig, launch_split, quant_matmul
from kernels.quant_pack import pack_quantized
from kernels.rope_cache import rope_and_cache
from kernels.split_sum import SplitSum
from test_quant_matmul import DEVICE, random_weight

GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MODULES, LAYERS, SLOTS = 7, 2, 3


def _adapter(K: int, widths: tuple[int, ...], ranks: tuple[int, ...], max_rank: int, slot: int, layer: int,
             gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A pool and row tables holding one adapter in `slot` at `layer` for modules 0.. (q, k, v) of these ranks (0:
    absent), rows placed out of order with gaps; other entries are decoys of the same layout."""
    a_off = torch.zeros(SLOTS, LAYERS, MODULES, max_rank, dtype=torch.int64)
    b_off = torch.zeros_like(a_off)
    rank_t = torch.zeros(SLOTS, LAYERS, MODULES, dtype=torch.int32)
    chunks, at = [], 0

    def place(n: int) -> int:
        nonlocal at
        chunks.append((torch.randn(n + 8, generator=gen) * 0.05).to(torch.bfloat16))
        at += n + 8
        return at - n - 8 + 4
    for entry_slot, entry_layer in ((slot, layer), ((slot + 1) % SLOTS, layer), (slot, 1 - layer)):
        for m, (width, rank) in enumerate(zip(widths, ranks)):
            rank_t[entry_slot, entry_layer, m] = rank
            for r in reversed(range(rank)):
                a_off[entry_slot, entry_layer, m, r] = place(K)
                b_off[entry_slot, entry_layer, m, r] = place(width)
    pool = torch.cat(chunks)
    return (pool.to(DEVICE), a_off.to(DEVICE), b_off.to(DEVICE), rank_t.to(DEVICE))


def _close(got: list, ref: list) -> None:
    """q and the caches alike up to rounding: the sums round to bfloat16 in another order (and without a split the
    base output rounds before the delta is added), and RoPE's products and differences round again, so an element
    may differ by a few units in the last place of the largest operand (here 2**-6 of the largest magnitude)."""
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2.0 ** -6 * float(r.abs().max()))


def _case(K, heads, kv_heads, D, ranks, max_rank, slot, gen, cfg):
    widths = (heads * D, kv_heads * D, kv_heads * D)
    N = sum(widths)
    q, s, o = random_weight(N, K, 4, 128, gen)
    w = pack_quantized(q, s, o, 4, 128)
    x = (torch.randn(1, K, generator=gen)).to(torch.bfloat16).to(DEVICE)
    pool, a_off, b_off, rank_t = _adapter(K, widths, ranks, max_rank, max(slot, 0), 1, gen)
    lp = LoraParts(pool, a_off, b_off, rank_t, torch.tensor([slot], dtype=torch.int32, device=DEVICE),
                   torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE), 1, widths,
                   parts_buffer(3, max_rank, torch.device(DEVICE)))
    split = launch_split(cfg, w)
    parts = torch.full((split, 1, N), float("nan"), device=DEVICE)
    out = torch.full((1, N), float("nan"), dtype=x.dtype, device=DEVICE)
    quant_matmul(x, w, None, out, cfg, parts, None, defer_split=split > 1, lora_parts=lp)
    assert lp.splits == split
    base = SplitSum(parts, x.dtype) if split > 1 else out
    wd = torch.empty(N, K, device=DEVICE)
    dequantize_packed(w, wd)
    return x, w, wd, lp, base, widths


@pytest.mark.parametrize("ranks,slot", [((8, 4, 0), 1), ((16, 16, 16), 2), ((8, 4, 8), -1)])
@pytest.mark.parametrize("cfg", [QuantMatmulConfig(32, 1, 2), QuantMatmulConfig(32, 1, 1), QuantMatmulConfig(16, 1, 3)])
def test_parts_sum_to_the_shrink_and_rope_adds_the_delta(ranks, slot, cfg) -> None:
    gen = torch.Generator().manual_seed(sum(ranks) + slot + cfg.split_k)
    heads, kv_heads, D, K, max_rank = 4, 2, 16, 768, 16
    x, w, wd, lp, base, widths = _case(K, heads, kv_heads, D, ranks, max_rank, slot, gen, cfg)
    want = reference_delta(x, lp, slot)
    for i, rank in enumerate(ranks):
        if slot < 0 or rank == 0:
            continue
        got = lp.parts[: lp.splits, i, :rank].sum(0)
        A = torch.stack([lp.pool[int(o): int(o) + K] for o in lp.a_offsets[slot, 1, i, :rank]]).float()
        torch.testing.assert_close(got, (x.float() @ A.T)[0], rtol=1e-4, atol=1e-4)
    T, blocks, block = 1, 4, 8
    pos = torch.tensor([5], device=DEVICE)
    slots = torch.tensor([13], device=DEVICE)
    ang = torch.rand(16, D, generator=gen).to(DEVICE)
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    # the reference: base projection in float32 plus the float32 delta, rounded once, then RoPE + cache as always
    qkv_ref = ((x.float() @ wd.T) + torch.cat(want, dim=1)).to(x.dtype)
    got, ref = [], []
    for src, extra, sink in ((base, lp, got), (qkv_ref, None, ref)):
        q = torch.empty(T, heads, D, dtype=x.dtype, device=DEVICE)
        kc = torch.zeros(blocks, block, kv_heads, D, dtype=x.dtype, device=DEVICE)
        vc = torch.zeros_like(kc)
        rope_and_cache(src, pos, slots, cos, sin, q, kc, vc, extra)
        sink += [q, kc, vc]
    _close(got, ref)
    if slot < 0:        # no adapter: exactly the base projection
        plain = []
        for extra in (None,):
            q = torch.empty(T, heads, D, dtype=x.dtype, device=DEVICE)
            kc = torch.zeros(blocks, block, kv_heads, D, dtype=x.dtype, device=DEVICE)
            vc = torch.zeros_like(kc)
            rope_and_cache(base, pos, slots, cos, sin, q, kc, vc, extra)
            plain += [q, kc, vc]
        for g, p in zip(got, plain):
            assert torch.equal(g, p)


def test_refusals() -> None:
    gen = torch.Generator().manual_seed(3)
    cfg = QuantMatmulConfig(32, 1, 2)
    x, w, wd, lp, base, widths = _case(512, 4, 2, 16, (4, 4, 4), 16, 1, gen, cfg)
    out = torch.empty(2, w.out_features, dtype=x.dtype, device=DEVICE)
    with pytest.raises(ValueError, match="one row"):
        quant_matmul(x.expand(2, -1).contiguous(), w, None, out, cfg, torch.empty(4 * w.out_features, device=DEVICE),
                     torch.zeros(64, dtype=torch.int32, device=DEVICE), lora_parts=lp)
    with pytest.raises(ValueError, match="register-set one-row kernel"):
        quant_matmul(x, w, None, out[:1], QuantMatmulConfig(32, 16, 1), None, None, lora_parts=lp)
    q = torch.empty(1, 4, 16, dtype=x.dtype, device=DEVICE)
    kc = torch.zeros(4, 8, 2, 16, dtype=x.dtype, device=DEVICE)
    lp.widths = (64, 32)
    with pytest.raises(ValueError, match="q/k/v widths"):
        rope_and_cache(base, torch.tensor([1], device=DEVICE), torch.tensor([2], device=DEVICE),
                       torch.ones(4, 16, device=DEVICE), torch.zeros(4, 16, device=DEVICE), q, kc, kc.clone(), lp)


@GPU_ONLY
@pytest.mark.gpu
@pytest.mark.parametrize("rank", [16, 64])
def test_gpu_8b_qkv(rank: int) -> None:
    """The 8B's q/k/v (32 heads, 8 KV heads of 128; K 4096) at pick_config's one-row choice, a pool of largest rank
    256: the parts' sums against the float32 shrink, RoPE + cache against the reference."""
    from kernels.quant_matmul import pick_config

    gen = torch.Generator().manual_seed(rank)
    cfg = pick_config(1, 6144, 4096, 4, torch.cuda.get_device_properties(0).multi_processor_count, 128)
    x, w, wd, lp, base, widths = _case(4096, 32, 8, 128, (rank, rank, rank), 256, 2, gen, cfg)
    want = reference_delta(x, lp, 2)
    pos, slots = torch.tensor([5], device=DEVICE), torch.tensor([13], device=DEVICE)
    ang = torch.rand(16, 128, generator=gen).to(DEVICE)
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    qkv_ref = ((x.float() @ wd.T) + torch.cat(want, dim=1)).to(x.dtype)
    got, ref = [], []
    for src, extra, sink in ((base, lp, got), (qkv_ref, None, ref)):
        q = torch.empty(1, 32, 128, dtype=x.dtype, device=DEVICE)
        kc = torch.zeros(4, 16, 8, 128, dtype=x.dtype, device=DEVICE)
        vc = torch.zeros_like(kc)
        rope_and_cache(src, pos, slots, cos, sin, q, kc, vc, extra)
        sink += [q, kc, vc]
    _close(got, ref)
