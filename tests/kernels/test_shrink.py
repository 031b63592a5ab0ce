"""Triton shrink against dense fp32 math: mixed ranks, several slices, tokens without adapter, poisoned output.

On CPU this runs in Triton's interpreter with small shapes (fp16/fp32; bf16 is
wrong in the interpreter); the `gpu` tests use larger shapes and bf16.
"""
import pytest
import torch

from kernels import lora_shrink
from kernels.shrink import lora_shrink_triton
from lora_case import DEVICE, build_case, dense_shrink, prepare_meta, random_slot_ids, rel_err

TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5 if DEVICE == "cpu" else 2e-3}


def run_shrink(case, T, frac_none, mods, layer, gen, slots=None, dtype=torch.float16, config=None):
    slots = slots if slots is not None else sorted({s for s, _, _ in case.dense})
    ids = random_slot_ids(T, slots, frac_none, gen)
    meta = prepare_meta(ids, case.tables.max_slots)
    x = torch.randn(T, case.h_in, generator=gen).to(dtype).to(DEVICE)
    out = torch.full((len(mods), T, case.tables.max_rank), float("nan"), device=DEVICE)
    if config:
        lora_shrink_triton(x, case.pool, case.tables, meta, layer, mods, out, config=config)
    else:
        lora_shrink(x, case.pool, case.tables, meta, layer, mods, out, use_triton=True)
    want, defined = dense_shrink(case, x, ids, layer, mods)
    got = out.cpu()
    if defined.any():
        err = rel_err(got[defined], want[defined])
        assert err < TOL[dtype], f"rel err {err} (T={T}, none={frac_none}, mods={mods})"
    return got, defined


@pytest.mark.parametrize(
    "dtype,T,frac_none,mods",
    [
        (torch.float16, 7, 0.0, [0]),
        (torch.float16, 7, 0.5, [0, 1, 2]),
        (torch.float16, 7, 1.0, [1, 2]),
        (torch.float32, 33, 0.3, [2, 0]),
        (torch.float16, 140, 0.2, [0, 1, 2]),    # above the decode threshold: prefill tiles
        (torch.float32, 150, 0.0, [1]),
        (torch.bfloat16, 7, 0.5, [0, 1, 2]),     # bf16: on the CPU through `kernels.dots` (the interpreter's bug)
        (torch.bfloat16, 140, 0.2, [0, 2]),
    ],
)
def test_shrink_matches_dense(dtype, T, frac_none, mods):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    # Slot 5 has no q module; slot 6 is allocated but gets no tokens (an empty segment).
    case = build_case(ranks={0: [16, 4, 1], 3: [2, 16, 9], 5: [0, 5, 16], 6: [8, 8, 8]}, h_in=97,
                      outs=[40, 24, 17], dtype=dtype, gen=gen)
    run_shrink(case, T, frac_none, mods, layer=1, gen=gen, slots=[0, 3, 5], dtype=dtype)


@pytest.mark.parametrize("h_in,ranks", [(576, {0: [1], 2: [256], 4: [37]}), (2049, {1: [64], 3: [7], 7: [16]})])
def test_shrink_mixed_ranks_odd_hidden(h_in, ranks):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = build_case(ranks=ranks, h_in=h_in, outs=[48], num_layers=1, dtype=torch.float16, gen=gen)
    run_shrink(case, 9, 0.1, [0], layer=0, gen=gen)
    # The split-K (atomic) path, forced where the interpreter's small grid would not choose it.
    run_shrink(case, 9, 0.1, [0], layer=0, gen=gen, config={"SPLIT_K": 3})
    run_shrink(case, 150, 0.1, [0], layer=0, gen=gen, config={"SPLIT_K": 2})
    # Decode's one program per slice and split walking a rank of 256 in 64- and 32-row blocks.
    run_shrink(case, 9, 0.1, [0], layer=0, gen=gen, config={"SPLIT_K": 2, "BLOCK_R": 32})


def test_split_shrink_adds_into_zeros_the_caller_gives():
    """With out_zeroed the wrapper launches no zeroing: a K split then adds into what `out` holds, so the
    caller's zeros give the sums and anything else shows up in them (the flag really skips the zeroing)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = build_case(ranks={0: [16], 2: [5]}, h_in=96, outs=[32], num_layers=1, dtype=torch.float16, gen=gen)
    ids = random_slot_ids(9, [0, 2], 0.2, gen)
    meta = prepare_meta(ids, case.tables.max_slots)
    x = torch.randn(9, 96, generator=gen).half().to(DEVICE)
    want, defined = dense_shrink(case, x, ids, 0, [0])
    for start, zeroed in ((float("nan"), False), (0.0, True), (1.0, True)):
        out = torch.full((1, 9, case.tables.max_rank), start, device=DEVICE)
        lora_shrink_triton(x, case.pool, case.tables, meta, 0, [0], out, config={"SPLIT_K": 3, "BLOCK_K": 32}, out_zeroed=zeroed)
        err = rel_err(out.cpu()[defined], want[defined] + (start if zeroed else 0.0))
        assert err < TOL[torch.float16], f"start {start}, out_zeroed {zeroed}: rel err {err}"


def test_shrink_checks_inputs():
    gen = torch.Generator().manual_seed(0)
    case = build_case(ranks={0: [4]}, h_in=32, outs=[16], num_layers=1, gen=gen)
    meta = prepare_meta(torch.zeros(4, dtype=torch.int32), case.tables.max_slots)
    x = torch.randn(4, 32).half().to(DEVICE)
    out = torch.empty(1, 4, case.tables.max_rank, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        lora_shrink(x, case.pool, case.tables, meta, 0, [0], out.half(), use_triton=True)
    with pytest.raises(ValueError, match="differs from pool dtype"):
        lora_shrink(x.float(), case.pool, case.tables, meta, 0, [0], out, use_triton=True)
    with pytest.raises(ValueError, match="layer 1 out of range"):
        lora_shrink(x, case.pool, case.tables, meta, 1, [0], out, use_triton=True)
    with pytest.raises(ValueError, match="out must be"):
        lora_shrink(x, case.pool, case.tables, meta, 0, [0, 0], out, use_triton=True)


@pytest.mark.gpu
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 16, 128, 129, 1000, 4096])
@pytest.mark.parametrize("h_in,mods", [(4096, [0, 1, 2]), (14336, [0])])
def test_shrink_gpu_large(dtype, T, h_in, mods, aligned):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ranks = {s: [[8, 16, 64, 256][(s + i) % 4] for i in range(3)] for s in range(12)}
    ranks[3][1] = 0
    case = build_case(ranks=ranks, h_in=h_in, outs=[64, 32, 32], num_layers=2, max_slots=16, dtype=dtype, gen=gen,
                      page_elems=2 * h_in if aligned else None)
    run_shrink(case, T, 0.25, mods, layer=1, gen=gen, dtype=dtype)
