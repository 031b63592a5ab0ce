"""Triton expand (and shrink -> expand) against dense fp32 math; untouched rows and columns stay untouched."""
import pytest
import torch

from kernels import lora_expand, lora_shrink
from kernels.expand import lora_expand_triton
from lora_case import (DEVICE, assert_untouched, build_case, dense_expand, dense_shrink, prepare_meta, random_slot_ids,
                       rel_err)

TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5 if DEVICE == "cpu" else 2e-3}


def run_expand(case, T, frac_none, mods, layer, gen, slots=None, dtype=torch.float16, extra_cols=3, config=None):
    slots = slots if slots is not None else sorted({s for s, _, _ in case.dense})
    ids = random_slot_ids(T, slots, frac_none, gen)
    meta = prepare_meta(ids, case.tables.max_slots)
    offs = [0]
    for m in mods:
        offs.append(offs[-1] + case.outs[m])
    s = torch.randn(len(mods), T, case.tables.max_rank, generator=gen).to(DEVICE)
    y0 = torch.randn(T, offs[-1] + extra_cols, generator=gen).to(dtype).to(DEVICE)
    y = y0.clone()
    if config:
        lora_expand_triton(s, case.pool, case.tables, meta, layer, mods, y, offs, config=config)
    else:
        lora_expand(s, case.pool, case.tables, meta, layer, mods, y, offs, use_triton=True)
    want = dense_expand(case, s, y0, ids, layer, mods, offs)
    err = rel_err(y, want)
    assert err < TOL[dtype], f"rel err {err} (T={T}, none={frac_none}, mods={mods})"
    assert_untouched(case, y, y0, ids, slots, layer, mods, offs)


@pytest.mark.parametrize(
    "dtype,T,frac_none,mods",
    [
        (torch.float16, 7, 0.0, [0]),
        (torch.float16, 7, 0.5, [0, 1, 2]),
        (torch.float16, 6, 1.0, [1, 2]),
        (torch.float32, 33, 0.3, [2, 0]),
        (torch.float16, 140, 0.2, [0, 1, 2]),
        (torch.float32, 150, 0.0, [1]),
        (torch.bfloat16, 7, 0.5, [0, 1, 2]),     # bf16: on the CPU through `kernels.dots` (the interpreter's bug)
        (torch.bfloat16, 140, 0.2, [0, 2]),
    ],
)
def test_expand_matches_dense(dtype, T, frac_none, mods):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = build_case(ranks={0: [16, 4, 1], 3: [2, 16, 9], 5: [0, 5, 16], 6: [8, 8, 8]}, h_in=40,
                      outs=[97, 24, 17], dtype=dtype, gen=gen)
    run_expand(case, T, frac_none, mods, layer=1, gen=gen, slots=[0, 3, 5], dtype=dtype)


@pytest.mark.parametrize("out,ranks", [(576, {0: [1], 2: [256], 4: [37]}), (2049, {1: [64], 3: [7], 7: [16]})])
def test_expand_mixed_ranks_odd_width(out, ranks):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = build_case(ranks=ranks, h_in=32, outs=[out], num_layers=1, dtype=torch.float16, gen=gen)
    run_expand(case, 9, 0.1, [0], layer=0, gen=gen)
    # Column groups of several blocks per program, as large batches get on the GPU.
    run_expand(case, 9, 0.1, [0], layer=0, gen=gen, config={"GROUP_N": 256})
    # Both rank-block sizes a pool above 32 takes at decode (expand_config: 32 rows in launches of many
    # programs an SM, the interpreter's case, else 64): a rank of 256 in 8 or 4 passes.
    run_expand(case, 9, 0.1, [0], layer=0, gen=gen, config={"GROUP_N": 256, "BLOCK_R": 64})


@pytest.mark.parametrize("T", [9, 140])
def test_aligned_rows_and_whole_column_blocks(T):
    """Pages and widths multiples of 8 and of the column block: the vector-load, unmasked-column path."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = build_case(ranks={0: [16, 8], 2: [64, 1], 5: [3, 32]}, h_in=256, outs=[256, 128], dtype=torch.float16,
                      gen=gen, page_elems=1024)
    assert case.tables.row_alignment() == 8
    run_expand(case, T, 0.2, [0, 1], layer=1, gen=gen, extra_cols=0)
    ids = random_slot_ids(T, [0, 2, 5], 0.2, gen)
    meta = prepare_meta(ids, case.tables.max_slots)
    x = torch.randn(T, 256, generator=gen).half().to(DEVICE)
    s = torch.full((2, T, case.tables.max_rank), float("nan"), device=DEVICE)
    lora_shrink(x, case.pool, case.tables, meta, 1, [0, 1], s, use_triton=True)
    want, defined = dense_shrink(case, x, ids, 1, [0, 1])
    assert rel_err(s.cpu()[defined], want[defined]) < 1e-3


@pytest.mark.parametrize("T", [5, 131])
def test_shrink_then_expand(T):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = build_case(ranks={1: [8, 16], 2: [32, 1], 4: [3, 0]}, h_in=72, outs=[50, 30], dtype=torch.float16, gen=gen)
    ids = random_slot_ids(T, [1, 2, 4], 0.25, gen)
    meta = prepare_meta(ids, case.tables.max_slots)
    x = torch.randn(T, 72, generator=gen).half().to(DEVICE)
    y0 = torch.randn(T, 80, generator=gen).half().to(DEVICE)
    s = torch.full((2, T, case.tables.max_rank), float("nan"), device=DEVICE)
    y = y0.clone()
    lora_shrink(x, case.pool, case.tables, meta, 0, [0, 1], s, use_triton=True)
    lora_expand(s, case.pool, case.tables, meta, 0, [0, 1], y, [0, 50, 80], use_triton=True)
    want_s, _ = dense_shrink(case, x, ids, 0, [0, 1])
    want = dense_expand(case, want_s, y0, ids, 0, [0, 1], [0, 50, 80])
    assert rel_err(y, want) < 1e-3


def test_expand_checks_inputs():
    gen = torch.Generator().manual_seed(0)
    case = build_case(ranks={0: [4]}, h_in=32, outs=[16], num_layers=1, gen=gen)
    meta = prepare_meta(torch.zeros(4, dtype=torch.int32), case.tables.max_slots)
    s = torch.randn(1, 4, case.tables.max_rank, device=DEVICE)
    y = torch.randn(4, 16).half().to(DEVICE)
    with pytest.raises(ValueError, match="increasing boundaries"):
        lora_expand(s, case.pool, case.tables, meta, 0, [0], y, [0], use_triton=True)
    with pytest.raises(ValueError, match="beyond y's"):
        lora_expand(s, case.pool, case.tables, meta, 0, [0], y, [0, 17], use_triton=True)
    with pytest.raises(ValueError, match="differs from pool dtype"):
        lora_expand(s, case.pool, case.tables, meta, 0, [0], y.float(), [0, 16], use_triton=True)
    with pytest.raises(ValueError, match="prepared for 4 tokens"):
        lora_expand(s[:, :3].contiguous(), case.pool, case.tables, meta, 0, [0], y[:3], [0, 16], use_triton=True)


@pytest.mark.gpu
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 16, 128, 129, 1000, 4096])
@pytest.mark.parametrize("outs,mods", [([4096, 1024, 1024], [0, 1, 2]), ([14336, 4096, 4096], [1])])
def test_expand_gpu_large(dtype, T, outs, mods, aligned):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ranks = {s: [[8, 16, 64, 256][(s + i) % 4] for i in range(3)] for s in range(12)}
    ranks[3][1] = 0
    case = build_case(ranks=ranks, h_in=64, outs=outs, num_layers=2, max_slots=16, dtype=dtype, gen=gen,
                      page_elems=2 * max(64, *outs) if aligned else None)
    run_expand(case, T, 0.25, mods, layer=1, gen=gen, dtype=dtype)
