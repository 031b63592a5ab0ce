"""The one-token LoRA's expand in the one-row base kernels' epilogue (kernels/lora_tail.py, LORAPLEX_LORA_TAIL=1):
the shrink launch into zeros, then the dense GEMV or the 4-bit one-row kernel adding s @ B^T for its features,
against the fp32 product plus the dense LoRA oracle. Slices of odd widths (a program's features straddle two),
an adapter lacking a module, a token without an adapter, ranks above one rank block, split-K (the first split
adds it) and every one-row path of the 4-bit kernel."""
import pytest
import torch

from kernels import lora_shrink
from kernels.dense_gemv import DenseGemvConfig, dense_gemv
from kernels.lora_tail import TailArgs
from kernels.quant_matmul import QuantMatmulConfig, quant_matmul
from kernels.quant_pack import pack_quantized
from kernels.reference import quant_matmul_ref
from lora_case import DEVICE, build_case, dense_expand, dense_shrink, prepare_meta, rel_err
from test_quant_matmul import random_weight

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
RANKS = {0: [16, 4, 1], 3: [2, 16, 9], 5: [0, 5, 16]}       # slot 5 lacks module 0
LARGE = {0: [3, 16], 2: [40, 1], 4: [200, 16]}              # a pool of rank 200: rank blocks of 64


def shrink_and_tail(case, x, slot: int, layer: int, mods: list[int]):
    """The shrink launch for one token of `slot` (-1: none) and the tail's arguments; the oracle's delta
    [1, sum(widths)] in fp32."""
    ids = torch.tensor([slot], dtype=torch.int32)
    meta = prepare_meta(ids, case.tables.max_slots)
    R = case.tables.max_rank
    s = torch.zeros(len(mods), 1, R, dtype=torch.float32, device=DEVICE)
    lora_shrink(x, case.pool, case.tables, meta, layer, mods, s, use_triton=True, out_zeroed=True, always=True)
    offs = [0]
    for m in mods:
        offs.append(offs[-1] + case.outs[m])
    tail = TailArgs(s.view(len(mods), R), case.pool, case.tables.b_offsets, case.tables.ranks, meta.seg_slots,
                    layer, case.tables.num_layers, case.tables.num_modules, R, tuple(mods), tuple(offs[:-1]))
    want_s, _ = dense_shrink(case, x, ids, layer, mods)
    delta = dense_expand(case, want_s, torch.zeros(1, offs[-1]), ids, layer, mods, offs)
    return tail, delta


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ranks,outs,mods", [(RANKS, [97, 24, 17], [0, 1, 2]), (RANKS, [40, 24, 17], [2, 1]),
                                              (LARGE, [70, 33], [0, 1])])
def test_dense_gemv_adds_the_tail(dtype, ranks, outs, mods):
    gen = torch.Generator().manual_seed(11)
    k = 96
    case = build_case(ranks=ranks, h_in=k, outs=outs, dtype=dtype, gen=gen)
    n = sum(outs[m] for m in mods)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    base = w.float().cpu() @ x.float().cpu().t() + bias.float().cpu()[:, None]
    for slot in [*ranks, -1]:
        tail, delta = shrink_and_tail(case, x, slot, 1, mods)
        out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
        dense_gemv(x, w, bias, out, DenseGemvConfig(16, 32, 4), tail=tail)
        want = base.t() + delta
        assert rel_err(out, want) < TOL[dtype], (slot, rel_err(out, want))
        if slot >= 0:
            assert rel_err(base.t(), want) > 3 * TOL[dtype], "the adapter must move the output past the tolerance"


@pytest.mark.parametrize("cfg,group,dtype", [
    (QuantMatmulConfig(16, 1, 1), 128, torch.float16),
    (QuantMatmulConfig(16, 1, 3), 128, torch.float16),                 # split-K: the first split adds it
    (QuantMatmulConfig(32, 1, 2), 128, torch.bfloat16),                # float16 pairs (H2) on bf16 x
    (QuantMatmulConfig(32, 1, 2, tma_stages=3), 128, torch.bfloat16),  # the TMA-read form where it runs
    (QuantMatmulConfig(32, 1, 2, num_warps=1, thread_rows=True), 32, torch.float16),   # whole rows a thread
])
def test_quant_one_row_adds_the_tail(cfg, group, dtype):
    gen = torch.Generator().manual_seed(12)
    k, outs, mods = 768, [97, 24, 17], [0, 1, 2]
    case = build_case(ranks=RANKS, h_in=k, outs=outs, dtype=dtype, gen=gen)
    n = sum(outs)
    q, s, o = random_weight(n, k, 4, group, gen)
    w = pack_quantized(q, s, o, 4, group)
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    base = quant_matmul_ref(x, q, s, o).float().cpu()
    part = torch.full((cfg.split_k * n,), float("nan"), device=DEVICE)
    locks = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    for slot in (0, 5, -1):
        tail, delta = shrink_and_tail(case, x, slot, 0, mods)
        out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
        quant_matmul(x, w, None, out, cfg, part, locks, tail=tail)
        assert rel_err(out, base + delta) < TOL[dtype], (slot, rel_err(out, base + delta))
        assert int(locks.abs().sum()) == 0
        if slot >= 0:
            assert rel_err(base, base + delta) > 3 * TOL[dtype], "the adapter must move the output past the tolerance"


def test_tail_refusals():
    gen = torch.Generator().manual_seed(13)
    case = build_case(ranks=RANKS, h_in=64, outs=[32, 16, 16], dtype=torch.float16, gen=gen)
    x = torch.randn(1, 64, generator=gen).half().to(DEVICE)
    tail, _ = shrink_and_tail(case, x, 0, 0, [0, 1, 2])
    w = torch.randn(64, 64, generator=gen).half().to(DEVICE)
    out = torch.empty(1, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="not both"):
        dense_gemv(x, w, None, out, tail=tail, addend=torch.zeros(1, 64, device=DEVICE))
    q, s, o = random_weight(64, 256, 4, 128, gen)
    pw = pack_quantized(q, s, o, 4, 128)
    x2 = torch.randn(2, 256, generator=gen).half().to(DEVICE)
    with pytest.raises(ValueError, match="LoRA tail"):
        quant_matmul(x2, pw, None, torch.empty(2, 64, dtype=torch.float16, device=DEVICE),
                     QuantMatmulConfig(16, 16, 1), None, None, tail=tail)
    with pytest.raises(ValueError, match="slices"):
        TailArgs(tail.sums, tail.pool, tail.b_offsets, tail.ranks, tail.seg_slots, 0, 2, 3, 16, (0, 1), (0,))
