"""Fused LoRA (shrink + expand in one launch) against dense fp32 math, with and without a K split."""
import pytest
import torch

from kernels import lora_fused
from kernels.fused import DELTA_MAX_GROUPS, fused_config, fused_workspace, lora_fused_triton
from lora_case import DEVICE, assert_untouched, build_case, dense_expand, dense_shrink, prepare_meta, random_slot_ids, rel_err

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2, torch.float32: 1e-5 if DEVICE == "cpu" else 3e-3}
# Forces the split path (partials through the workspace, last split folds them into y) on small shapes.
SPLIT = {"SPLIT_K": 3, "BLOCK_K": 32, "BLOCK_N": 32, "GROUP_N": 64}


def run_fused(case, T, frac_none, mods, layer, gen, slots=None, dtype=torch.float16, extra_cols=3, config=None,
              device_meta=False, y_dtype=None):
    slots = slots if slots is not None else sorted({s for s, _, _ in case.dense})
    ids = random_slot_ids(T, slots, frac_none, gen)
    meta = prepare_meta(ids, case.tables.max_slots) if not device_meta else None
    if device_meta:
        from kernels import LoraBatchMeta
        meta = LoraBatchMeta(T + 3, case.tables.max_slots, device=DEVICE, device_build=True)
        meta.prepare(ids)
    offs = [0]
    for m in mods:
        offs.append(offs[-1] + case.outs[m])
    x = torch.randn(T, case.h_in, generator=gen).to(dtype).to(DEVICE)
    y0 = torch.randn(T, offs[-1] + extra_cols, generator=gen).to(y_dtype or dtype).to(DEVICE)
    y = y0.clone()
    ws = fused_workspace(T + 2, case.tables.max_rank, DEVICE)
    if config:
        lora_fused_triton(x, case.pool, case.tables, meta, layer, mods, y, offs, ws, config=config)
    else:
        lora_fused(x, case.pool, case.tables, meta, layer, mods, y, offs, ws, use_triton=True)
    want_s, _ = dense_shrink(case, x, ids, layer, mods)
    want = dense_expand(case, want_s, y0, ids, layer, mods, offs)
    err = rel_err(y, want)
    assert err < TOL[dtype], f"rel err {err} (T={T}, none={frac_none}, mods={mods}, config={config})"
    assert_untouched(case, y, y0, ids, slots, layer, mods, offs)
    assert not ws[0].any() and not ws[1].any(), "the workspace must be left all zeros"


@pytest.mark.parametrize(
    "dtype,T,frac_none,mods,config",
    [
        (torch.float16, 7, 0.0, [0], None),
        (torch.float16, 7, 0.5, [0, 1, 2], SPLIT),
        (torch.float16, 6, 1.0, [1, 2], SPLIT),
        (torch.float32, 33, 0.3, [2, 0], None),
        (torch.float32, 20, 0.2, [0, 1, 2], SPLIT),
        (torch.float16, 140, 0.2, [0, 1, 2], None),
        (torch.bfloat16, 7, 0.5, [0, 1, 2], SPLIT),  # bf16: on the CPU through `kernels.dots` (the interpreter's bug)
        (torch.bfloat16, 140, 0.2, [0, 2], None),
    ],
)
def test_fused_matches_dense(dtype, T, frac_none, mods, config):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    # Slot 6 gets no token (an empty segment); slot 5 lacks module 0.
    case = build_case(ranks={0: [16, 4, 1], 3: [2, 16, 9], 5: [0, 5, 16], 6: [8, 8, 8]}, h_in=72,
                      outs=[97, 24, 17], dtype=dtype, gen=gen)
    run_fused(case, T, frac_none, mods, layer=1, gen=gen, slots=[0, 3, 5], dtype=dtype, config=config)


@pytest.mark.parametrize("out,ranks", [(576, {0: [1], 2: [256], 4: [37]}), (129, {1: [64], 3: [7], 7: [128]})])
def test_fused_rank_classes_odd_widths(out, ranks):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = build_case(ranks=ranks, h_in=33, outs=[out], num_layers=1, dtype=torch.float16, gen=gen)
    run_fused(case, 9, 0.1, [0], layer=0, gen=gen)
    run_fused(case, 9, 0.1, [0], layer=0, gen=gen, config={"SPLIT_K": 2, "BLOCK_K": 16, "GROUP_N": 256})


def test_fused_with_device_built_metadata():
    """The segments kernel's metadata drives the fused kernel exactly as the host-built one does."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = build_case(ranks={1: [8, 16], 2: [32, 1], 4: [3, 0]}, h_in=64, outs=[50, 30], dtype=torch.float16,
                      gen=gen, page_elems=1024)
    run_fused(case, 11, 0.25, [0, 1], layer=0, gen=gen, slots=[1, 2, 4], config=SPLIT, device_meta=True)


def test_fused_config_is_graph_stable_and_splits_small_batches():
    dev = torch.device("cpu")
    a = fused_config(8, 4096, [4096, 1024, 1024], 16, 64, dev, num_sms=132)
    assert a == fused_config(8, 4096, [4096, 1024, 1024], 16, 64, dev, num_sms=132)
    assert a["SPLIT_K"] > 1 and a["K_PER_SPLIT"] % a["BLOCK_K"] == 0
    big = fused_config(4096, 4096, [4096, 1024, 1024], 64, 64, dev, num_sms=132)
    assert big["SPLIT_K"] == 1 and big["BLOCK_R"] == 64 and big["GROUP_N"] % big["BLOCK_N"] == 0
    assert big["GROUP_N"] > a["GROUP_N"]          # many tiles: wider column groups


def test_fused_config_caps_column_groups_of_a_one_token_delta():
    """One token into a float32 delta (the one-row base kernel adds it, running beside the launch): at most
    DELTA_MAX_GROUPS column groups; the 8B's gate/up goes from 224 groups to 28, q/k/v keeps its 48."""
    dev = torch.device("cpu")

    def groups(cfg, widths):
        return sum(-(-w // cfg["GROUP_N"]) for w in widths)

    gate_up = [14336, 14336]
    plain = fused_config(1, 4096, gate_up, 16, 8, dev, num_sms=132)
    capped = fused_config(1, 4096, gate_up, 16, 8, dev, num_sms=132, delta=True)
    assert groups(plain, gate_up) == 224 and groups(capped, gate_up) == 28
    assert capped["GROUP_N"] % capped["BLOCK_N"] == 0 and capped["SPLIT_K"] == plain["SPLIT_K"]
    qkv = [4096, 1024, 1024]
    assert fused_config(1, 4096, qkv, 16, 8, dev, num_sms=132, delta=True) == fused_config(1, 4096, qkv, 16, 8, dev,
                                                                                          num_sms=132)
    assert groups(fused_config(1, 4096, [4096] * 3, 16, 8, dev, num_sms=132, delta=True), [4096] * 3) <= DELTA_MAX_GROUPS
    assert fused_config(2, 4096, gate_up, 16, 8, dev, num_sms=132, delta=True) == fused_config(2, 4096, gate_up, 16,
                                                                                              8, dev, num_sms=132)


def test_fused_checks_inputs():
    gen = torch.Generator().manual_seed(0)
    case = build_case(ranks={0: [4]}, h_in=512, outs=[16], num_layers=1, gen=gen)
    meta = prepare_meta(torch.zeros(4, dtype=torch.int32), case.tables.max_slots)
    x = torch.randn(4, 512).half().to(DEVICE)
    y = torch.randn(4, 16).half().to(DEVICE)
    ws = fused_workspace(4, 4, DEVICE)
    with pytest.raises(ValueError, match="increasing boundaries"):
        lora_fused_triton(x, case.pool, case.tables, meta, 0, [0], y, [0], ws)
    with pytest.raises(ValueError, match="beyond y's"):
        lora_fused_triton(x, case.pool, case.tables, meta, 0, [0], y, [0, 17], ws)
    with pytest.raises(ValueError, match="differs from pool dtype"):
        lora_fused_triton(x.float(), case.pool, case.tables, meta, 0, [0], y, [0, 16], ws)
    with pytest.raises(ValueError, match="needs a workspace"):
        lora_fused_triton(x, case.pool, case.tables, meta, 0, [0], y, [0, 16], None)
    with pytest.raises(ValueError, match="workspace sums"):
        lora_fused_triton(x, case.pool, case.tables, meta, 0, [0], y, [0, 16], fused_workspace(2, 4, DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 8, 64, 129, 1000, 4096])
@pytest.mark.parametrize("h_in,outs,mods", [(4096, [4096, 1024, 1024], [0, 1, 2]), (4096, [14336, 14336], [0, 1]),
                                            (14336, [4096], [0])])
def test_fused_gpu_llama_shapes(dtype, T, h_in, outs, mods):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ranks = {s: [[8, 16, 64, 256][(s + i) % 4] for i in range(len(outs))] for s in range(12)}
    ranks[3][0] = 0
    case = build_case(ranks=ranks, h_in=h_in, outs=outs, num_layers=2, max_slots=16, dtype=dtype, gen=gen,
                      page_elems=2 * max(h_in, *outs))
    run_fused(case, T, 0.25, mods, layer=1, gen=gen, dtype=dtype, device_meta=True)


@pytest.mark.parametrize("config", [None, SPLIT])
def test_float32_delta_output(config):
    """A float32 y (the LoRA delta of a one-token step, which the base projection's one-row kernel adds):
    16-bit adapters and x, the sums added into y in float32 and not rounded to 16 bits."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = build_case(ranks={0: [16, 4, 1], 3: [2, 16, 9], 5: [0, 5, 16]}, h_in=72, outs=[97, 24, 17],
                      dtype=torch.float16, gen=gen)
    for slots in ([0], [5], [3]):
        run_fused(case, 1, 0.0, [0, 1, 2], layer=1, gen=gen, slots=slots, dtype=torch.float16, config=config,
                  y_dtype=torch.float32)


def test_float32_delta_output_in_a_pool_of_larger_ranks():
    """One token into a float32 delta where the pool holds rank 200: an adapter of rank <= 16 takes the 16-row
    tiles, one of rank 40 one 64-row block, one of rank 200 four blocks in turn (kernels/fused.py)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = build_case(ranks={0: [3, 16], 2: [40, 1], 4: [200, 16], 6: [0, 64]}, h_in=96, outs=[160, 48],
                      dtype=torch.float16, gen=gen)
    for slots in ([0], [2], [4], [6]):
        run_fused(case, 1, 0.0, [0, 1], layer=1, gen=gen, slots=slots, dtype=torch.float16, y_dtype=torch.float32)
    run_fused(case, 12, 0.2, [0, 1], layer=0, gen=gen, slots=[0, 2, 4, 6], dtype=torch.float16)


def test_float32_delta_output_with_capped_column_groups():
    """A one-token float32 delta over more than DELTA_MAX_GROUPS default column groups: wider groups, each
    program expanding several blocks of columns, the same sums."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = build_case(ranks={0: [16, 8], 2: [4, 16]}, h_in=64, outs=[4096, 3200], dtype=torch.float16, gen=gen)
    cfg = fused_config(1, 64, [4096, 3200], case.tables.max_rank, case.tables.max_slots, torch.device("cpu"),
                       num_sms=132, delta=True)
    assert cfg["GROUP_N"] > cfg["BLOCK_N"]
    for slots in ([0], [2]):
        run_fused(case, 1, 0.0, [0, 1], layer=0, gen=gen, slots=slots, dtype=torch.float16, y_dtype=torch.float32)
