"""Weight-only quantized matmul against the fp32 dequantize-then-matmul reference.

On CPU this runs in Triton's interpreter with small shapes (its bf16 dots are wrong: interpreted,
the kernels' dots take fp32 operands, `kernels.dots`); the `gpu` tests use the 8B model's layer
shapes and bf16. Every case draws fresh
codes, scales, offsets and inputs, and poisons the output before the call.
"""
import dataclasses

import pytest
import torch

from kernels.quant_dequant import dequantize_packed
from kernels.quant_matmul import QuantMatmulConfig, dense_min_rows, pick_config, quant_matmul
from kernels.quant_pack import block_k, pack_quantized, unpack_quantized
from kernels.reference import quant_matmul_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# x rounded to its dtype, W rounded to x's dtype, fp32 accumulation (TF32-free IEEE dots for float32). The one-row
# kernel sums (BIAS + q) x per group and takes BIAS s sum(x) off after (BIAS 128 for 4 bits): those sums are ~16x
# the result's terms, so float32 rounds to ~2e-6 of the result (4.5e-6 the worst of 60 draws), the tile kernels to
# 3e-7; TF32 products (10-bit mantissas) would give 1e-4 or more.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 4e-5}


def random_weight(n: int, k: int, bits: int, group: int, gen: torch.Generator):
    q = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.002).half()
    offsets = (-torch.rand(n, k // group, generator=gen) * 2 ** (bits - 1) * 0.02).half()
    return q.to(DEVICE), scales.to(DEVICE), offsets.to(DEVICE)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "output left unwritten (NaN poison survived)"
    return ((got.float() - want).norm() / want.norm()).item()


def check(T: int, N: int, K: int, bits: int, group: int, dtype: torch.dtype, has_bias: bool,
          config: QuantMatmulConfig | None = None, gen: torch.Generator | None = None) -> float:
    gen = gen or torch.Generator().manual_seed(torch.seed() % 2**31)
    q, s, o = random_weight(N, K, bits, group, gen)
    w = pack_quantized(q, s, o, bits, group)
    x = torch.randn(T, K, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(dtype).to(DEVICE) if has_bias else None
    cfg = config or pick_config(T, N, K, bits, num_sms=4 if DEVICE == "cpu" else 132, group_size=group)
    out = torch.full((T, N), float("nan"), dtype=dtype, device=DEVICE)
    partials = torch.full((cfg.split_k * T * N,), float("nan"), device=DEVICE)
    locks = torch.zeros(4 * -(-N // 16), dtype=torch.int32, device=DEVICE)    # one per tile, as QuantLinear
    quant_matmul(x, w, bias, out, cfg, partials, locks)
    err = rel_err(out, quant_matmul_ref(x, q, s, o, bias))
    assert err < TOL[dtype], f"rel err {err} (T={T} N={N} K={K} bits={bits} G={group} {dtype} {cfg})"
    assert int(locks.abs().sum()) == 0, "split-K counters must be left at zero"
    return err


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_shapes_match_reference(bits: int, group: int, dtype: torch.dtype) -> None:
    # K = 384 is not a multiple of the 256-wide packed block (padded columns); N = 40 is not a multiple of 16.
    for T, has_bias in ((1, True), (5, False)):
        check(T, 40, 384, bits, group, dtype, has_bias)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("split", [1, 2, 3])
def test_split_k_and_tiles(bits: int, split: int) -> None:
    """Forced configs: split-K (the last program reduces), several token and feature tiles, odd T."""
    cfg = QuantMatmulConfig(block_n=16, block_m=16, split_k=split)
    check(19, 37, 768, bits, 64, torch.float16, True, cfg)
    check(3, 50, 512, bits, 32, torch.float32, False, cfg)
    check(40, 24, 512, bits, 128, torch.float16, True, QuantMatmulConfig(block_n=32, block_m=32, split_k=split))
    block = QuantMatmulConfig(block_n=16, block_m=16, split_k=split, field_dots=False)   # one dot per block
    check(19, 37, 768, bits, 64, torch.float16, True, block)
    check(3, 50, 640, bits, 32, torch.float32, False, block)
    row = QuantMatmulConfig(block_n=32, block_m=1, split_k=split)     # the one-row (elementwise) kernel
    check(1, 37, 768, bits, 128, torch.float16, True, row)
    check(3, 50, 640, bits, 32, torch.float32, False, row)


def test_few_rows_of_a_small_weight_take_the_one_row_kernel() -> None:
    """2-8 rows of a small weight (T * N <= 8192) run the one-row kernel, a program per row (faster than the
    tensor-core tiles at the default SmolLM2's sizes); more rows, or a large weight, the tensor cores."""
    assert pick_config(8, 960, 576, 4, 132, 32).block_m == 1
    assert pick_config(1, 576, 1536, 4, 132, 32).split_k == 6
    assert pick_config(8, 576, 1536, 4, 132, 32) == QuantMatmulConfig(32, 1, 4)     # split shrinks with rows
    assert pick_config(16, 960, 576, 4, 132, 32).block_m == 16
    assert pick_config(4, 3072, 576, 4, 132, 32).block_m == 16
    assert pick_config(2, 6144, 4096, 4, 132, 128).block_m == 16
    # through pick_config: 6 rows, split-K (2 splits at the interpreter's 4 programs' worth of SMs, 6 on the GPU)
    assert pick_config(6, 64, 1536, 4, 4, 32) == QuantMatmulConfig(32, 1, 2)
    check(6, 64, 1536, 4, 32, torch.float16, True)


@pytest.mark.parametrize("bits,k,dtype", [(4, 512, torch.float16), (4, 288, torch.float32), (8, 512, torch.float16),
                                          (4, 1024, torch.float32)])
@pytest.mark.parametrize("split,warps", [(1, 1), (3, 2)])
def test_one_row_whole_rows_a_thread(bits: int, k: int, dtype: torch.dtype, split: int, warps: int) -> None:
    """Groups of 32 with each thread holding whole rows (`thread_rows`): two or one rows a thread, ragged K
    (288: a block and a group), split-K, a bias, a partial program of rows."""
    check(1, 64, k, bits, 32, dtype, True, QuantMatmulConfig(64, 1, split, num_warps=warps, thread_rows=True))
    check(1, 40, k, bits, 32, dtype, False, QuantMatmulConfig(64, 1, split, num_warps=warps, thread_rows=True))
    rows = dict(num_warps=2, thread_rows=True)      # 8B q/k/v, o, gate/up: ~8 programs an SM, a power of two
    assert pick_config(1, 6144, 4096, 4, 132, 32) == QuantMatmulConfig(128, 1, 16, **rows)
    assert pick_config(1, 4096, 4096, 4, 132, 32) == QuantMatmulConfig(128, 1, 16, **rows)
    assert pick_config(1, 28672, 4096, 4, 132, 32) == QuantMatmulConfig(128, 1, 8, **rows)
    assert not pick_config(1, 4096, 14336, 4, 132, 32).thread_rows     # down (long K): the elementwise kernel
    assert not pick_config(1, 6144, 4096, 8, 132, 32).thread_rows      # 8 bits: not timed, elementwise
    assert not pick_config(1, 960, 576, 4, 132, 32).thread_rows         # a small weight: the elementwise kernel


@pytest.mark.parametrize("group,k", [(128, 512), (256, 768), (128, 1792)])
@pytest.mark.parametrize("split", [1, 2, 3])
def test_one_row_bf16_float16_pairs(group: int, k: int, split: int) -> None:
    """One row of bfloat16 x on 4 bits in groups of 128+ (`quant_gemv._halves_step_h2`: codes times x in float16
    pairs, two blocks a loop step): 2, 3 and 7 blocks, split so that a split holds an odd or even count of them
    (7 in 2: 4 + 3; in 3: 3 + 3 + 1), a bias, a partial program of rows (even and odd: each row's scales and
    offsets are read for its own words, `_tile_value`), 64- and 128-feature programs; whole programs of rows
    read their words unmasked (EVEN_N)."""
    check(1, 64, k, 4, group, torch.bfloat16, True, QuantMatmulConfig(64, 1, split))
    check(1, 40, k, 4, group, torch.bfloat16, False, QuantMatmulConfig(128, 1, split))
    check(1, 41, k, 4, group, torch.bfloat16, False, QuantMatmulConfig(64, 1, split))


@pytest.mark.parametrize("tma_stages", [0, 3])
def test_one_row_bf16_addend_and_large_x(tma_stages: int) -> None:
    """The float16-pairs path (its chains of 4 words: 96 words a row) adds a LoRA addend (and zeroes it); single
    elements of x beyond float16's range (1e5 and -7e4 in bf16) are exact there: x / 16 is what goes to float16
    (`kernels.quant_h2`'s bound, 2**15, is for every element of a chain that large). Both forms of the path: the
    register-set kernel and the TMA-read one (`kernels.quant_gemv_tma`, tma_stages)."""
    gen = torch.Generator().manual_seed(8)
    n, k = 40, 768
    q, s, o = random_weight(n, k, 4, 128, gen)
    w = pack_quantized(q, s, o, 4, 128)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    add = torch.randn(1, n, generator=gen).to(DEVICE)
    cfg = QuantMatmulConfig(32, 1, 2, tma_stages=tma_stages)
    part = torch.full((2 * n,), float("nan"), device=DEVICE)
    locks = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    addend = add.clone()
    quant_matmul(x, w, None, out, cfg, part, locks, addend=addend)
    assert rel_err(out.cpu(), quant_matmul_ref(x, q, s, o).cpu() + add.cpu()) < TOL[torch.bfloat16]
    assert not addend.any() and int(locks.abs().sum()) == 0
    x[0, 5] = 1e5
    x[0, 300] = -7e4
    quant_matmul(x, w, None, out, cfg, part, locks)
    assert rel_err(out.cpu(), quant_matmul_ref(x, q, s, o).cpu()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("where", ["any", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_one_row_bf16_words_not_16_byte_aligned(where: str) -> None:
    """Words that start 4 bytes past a 16-byte boundary (a contiguous view at an odd offset): the float16-pairs
    path's packs of 4 words need 16-byte reads, so this takes the fp32 path (`quant_matmul._quad_words`) and is
    still right. On a GPU the packs would otherwise group the wrong words (or not compile); the `gpu` case puts
    it in the GPU suites (`-m gpu`)."""
    gen = torch.Generator().manual_seed(9)
    n, k = 40, 512
    q, s, o = random_weight(n, k, 4, 128, gen)
    w = pack_quantized(q, s, o, 4, 128)
    buf = torch.zeros(w.words.numel() + 1, dtype=torch.int32, device=w.words.device)
    words = buf[1:].view(w.words.shape)
    words.copy_(w.words)
    w = dataclasses.replace(w, words=words)
    assert words.is_contiguous() and words.data_ptr() % 16 == 4
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    for cfg in (QuantMatmulConfig(64, 1, 1), QuantMatmulConfig(128, 1, 2)):
        part = torch.full((2 * n,), float("nan"), device=DEVICE)
        locks = torch.zeros(64, dtype=torch.int32, device=DEVICE)
        out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        quant_matmul(x, w, None, out, cfg, part, locks)
        assert rel_err(out.cpu(), quant_matmul_ref(x, q, s, o).cpu()) < TOL[torch.bfloat16]


def test_float16_pairs_switch(monkeypatch) -> None:
    """LORAPLEX_FP16_PAIRS=0 keeps the one-row kernel's fp32 products where the float16-pairs path would run (the
    launch's H2 flag, read from a stand-in for the kernel), and the result stays right."""
    import kernels.quant_matmul as qm

    gen = torch.Generator().manual_seed(10)
    q, s, o = random_weight(40, 512, 4, 128, gen)
    w = pack_quantized(q, s, o, 4, 128)
    x = torch.randn(1, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs["H2"])

    out = torch.full((1, 40), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    with monkeypatch.context() as m:
        m.setattr(qm, "quant_gemv_kernel", Recorder())
        quant_matmul(x, w, None, out, QuantMatmulConfig(64, 1, 1))
        m.setenv("LORAPLEX_FP16_PAIRS", "0")
        quant_matmul(x, w, None, out, QuantMatmulConfig(64, 1, 1))
    assert launches == [True, False]
    monkeypatch.setenv("LORAPLEX_FP16_PAIRS", "0")
    quant_matmul(x, w, None, out, QuantMatmulConfig(64, 1, 1))
    assert rel_err(out.cpu(), quant_matmul_ref(x, q, s, o).cpu()) < TOL[torch.bfloat16]


def test_one_row_pick_config_for_the_float16_pairs_path() -> None:
    """One row of the 8B's weights in groups of 128 with bfloat16 x: split to about three programs an SM, of 128
    features where those make two an SM, else 64 (o, down: the rule swept with split-K's partials left to the next
    kernel); gate/up (feature tiles alone fill the SMs) reads its words by TMA, split 4. Beside a LoRA launch the
    earlier rule: about two an SM of 128 features, gate/up split 2; where the launch sums its partials, the earlier
    rule's three an SM. float16 x keeps the fp32 path's 64 features."""
    assert pick_config(1, 28672, 4096, 4, 132, 128) == QuantMatmulConfig(128, 1, 4, tma_stages=2)  # gate/up: TMA
    assert pick_config(1, 6144, 4096, 4, 132, 128) == QuantMatmulConfig(128, 1, 8)        # q/k/v: 384
    assert pick_config(1, 4096, 4096, 4, 132, 128) == QuantMatmulConfig(64, 1, 8)         # o: 512
    assert pick_config(1, 4096, 14336, 4, 132, 128) == QuantMatmulConfig(64, 1, 8)        # down: 512
    lora = dict(beside_lora=True)
    assert pick_config(1, 28672, 4096, 4, 132, 128, **lora) == QuantMatmulConfig(128, 1, 2, tma_stages=2)
    assert pick_config(1, 6144, 4096, 4, 132, 128, **lora) == QuantMatmulConfig(128, 1, 4)     # 192
    assert pick_config(1, 4096, 4096, 4, 132, 128, **lora) == QuantMatmulConfig(128, 1, 8)     # 256
    summed = dict(deferred=False)       # the launch sums its own partials: the earlier rule too
    assert pick_config(1, 28672, 4096, 4, 132, 128, **summed) == QuantMatmulConfig(128, 1, 2, tma_stages=2)
    assert pick_config(1, 4096, 14336, 4, 132, 128, **summed) == QuantMatmulConfig(128, 1, 8)
    assert pick_config(1, 28672, 4096, 4, 132, 128, torch.float16).block_n == 64
    assert pick_config(1, 960, 576, 4, 132, 128).block_n != 128                           # a small weight


@pytest.mark.parametrize("group,k", [(128, 640), (256, 768), (512, 1024), (128, 4608)])
@pytest.mark.parametrize("split", [1, 3])
def test_pair_codes_path(group: int, k: int, split: int) -> None:
    """4 bits in groups of 128 and more, 16-bit x: the codes enter the dots as they are, each group's scale
    applies after them (`_pairs_step`) and the offsets' part after the loop (`_offsets_term`,
    in dots of 16 halves: K = 4608 unsplit has 36); padded K, a partial token tile and split-K. The scales,
    read a step ahead (`_block_scales`), come as 4-byte words of two rows for an even number of rows, as 16-bit
    values for an odd one (41). bfloat16 x as well (the served 8B's case; its codes under bf16's bias)."""
    check(19, 40, k, 4, group, torch.float16, True, QuantMatmulConfig(16, 16, split))
    check(7, 24, k, 4, group, torch.float16, False, QuantMatmulConfig(32, 32, split))
    check(5, 41, k, 4, group, torch.float16, False, QuantMatmulConfig(16, 16, split))
    check(6, 40, k, 4, group, torch.bfloat16, True, QuantMatmulConfig(16, 16, split))


@pytest.mark.parametrize("k", [288, 512, 1536])
@pytest.mark.parametrize("split", [1, 3])
def test_group_pairs_path(k: int, split: int) -> None:
    """4 bits in groups of 32, 16-bit x: fields i and i + 4 enter two dots as they are, each group's scale after
    its dot (`_group_pairs_step`), the offsets' part after the loop from sums of x per 32 (`_offsets_term`,
    dots of 16 groups: K = 1536 has 48); ragged K (288: a block and a group), partial tiles, split-K; bfloat16 x
    as well."""
    check(19, 40, k, 4, 32, torch.float16, True, QuantMatmulConfig(16, 16, split))
    check(7, 24, k, 4, 32, torch.float16, False, QuantMatmulConfig(32, 32, split))
    check(6, 40, k, 4, 32, torch.bfloat16, False, QuantMatmulConfig(16, 16, split))


@pytest.mark.parametrize("split", [1, 2])
def test_pair_codes_zero_and_negative_scales(split: int) -> None:
    """The pair-codes path divides its running sum by each half's scale: groups with a zero scale (every weight
    equal to its offset), negative scales (GGUF Q4_0's) and a zero group between them must still give the
    reference, and a tiny scale must not overflow."""
    gen = torch.Generator().manual_seed(11)
    q, s, o = random_weight(40, 768, 4, 128, gen)
    s[:, 1] = 0
    s[::2, 2] = -s[::2, 2]
    s[5, 3], o[5, 4], s[5, 4] = 6e-8, 0, 0                  # the smallest float16 scale, then an all-zero group
    w = pack_quantized(q, s, o, 4, 128)
    x = torch.randn(20, 768, generator=gen).half().to(DEVICE)
    out = torch.full((20, 40), float("nan"), dtype=torch.float16, device=DEVICE)
    cfg = QuantMatmulConfig(16, 16, split)
    quant_matmul(x, w, None, out, cfg, torch.empty(split * 20 * 40, device=DEVICE),
                 torch.zeros(16, dtype=torch.int32, device=DEVICE))
    assert rel_err(out, quant_matmul_ref(x, q, s, o, None)) < TOL[torch.float16]


@pytest.mark.parametrize("bits,group", [(4, 256), (4, 512), (8, 256)])
def test_groups_spanning_whole_blocks(bits: int, group: int) -> None:
    check(6, 40, 1024, bits, group, torch.float16, True, QuantMatmulConfig(16, 16, 2))
    check(1, 40, 1024, bits, group, torch.float16, True, QuantMatmulConfig(16, 1, 2))     # one-row kernel


def test_prefill_tile() -> None:
    check(70, 24, 256, 4, 128, torch.float16, True)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (8, 128)])
@pytest.mark.parametrize("field_dots", [True, False])
def test_tiles_in_bf16(bits: int, group: int, field_dots: bool) -> None:
    """The tensor-core tiles with bfloat16 x and the weight dequantized to bf16 (every layout but 4 bits in groups
    of 128+): one dot per field and one per 256-wide block. Interpreted, the dots take fp32 operands
    (`kernels.dots`: the interpreter's bf16 dots are wrong), so this checks the tiles' own arithmetic."""
    check(6, 40, 512, bits, group, torch.bfloat16, True, QuantMatmulConfig(16, 16, 2, field_dots=field_dots))
    check(20, 24, 384, bits, group, torch.bfloat16, False, QuantMatmulConfig(32, 32, 1, field_dots=field_dots))


def test_many_rows_of_a_large_pair_codes_weight() -> None:
    """Above 64 rows a large 4-bit weight in groups of 128+ keeps the pair-codes tiles (64 x 64, the decode
    split rule) up to dense_min_rows; groups of 32 pair codes up to 128 rows; other layouts take the prefill
    tile, and dense from 65 rows."""
    assert pick_config(128, 28672, 4096, 4, 132) == QuantMatmulConfig(64, 64, 1)
    assert pick_config(128, 4096, 4096, 4, 132) == QuantMatmulConfig(64, 64, 2)      # 128 tiles: split 2
    assert pick_config(255, 4096, 14336, 4, 132) == QuantMatmulConfig(64, 64, 1)
    assert pick_config(383, 6144, 4096, 4, 132) == QuantMatmulConfig(64, 64, 1)
    # 65-128 rows of a large 4-bit weight in groups of 32: pair codes (128 x 128 on 8 warps where 128-feature
    # tiles fill the SMs, else 64 x 64, split 2 below a tile an SM), dense from 129; other layouts the prefill tile
    assert pick_config(128, 28672, 4096, 4, 132, 32) == QuantMatmulConfig(128, 128, 1, num_warps=8)
    assert pick_config(96, 6144, 4096, 4, 132, 32) == QuantMatmulConfig(64, 64, 1)
    assert pick_config(128, 4096, 4096, 4, 132, 32) == QuantMatmulConfig(64, 64, 2)
    assert pick_config(128, 4096, 14336, 4, 132, 32) == QuantMatmulConfig(64, 64, 2)
    assert pick_config(128, 4096, 4096, 4, 132, 64) == QuantMatmulConfig(128, 64, 1, num_warps=8)
    assert pick_config(128, 4096, 4096, 8, 132, 32) == QuantMatmulConfig(128, 64, 1, num_warps=8)
    assert dense_min_rows(4096, 4096, 4, 32) == 129 and dense_min_rows(960, 576, 4, 32) == 65
    check(96, 128, 512, 4, 32, torch.float16, True, QuantMatmulConfig(128, 128, 1, num_warps=8))
    # 33-64 rows of a large 4-bit weight in groups of 32: pair codes in 64 x 64 tiles, split 4 unless they fill
    # the SMs twice; other layouts (groups of 64, 8 bits) one dot per block, no split (wide tiles where they fill)
    assert pick_config(64, 6144, 4096, 4, 132, 32) == QuantMatmulConfig(64, 64, 4)
    assert pick_config(48, 28672, 4096, 4, 132, 32) == QuantMatmulConfig(64, 64, 1)
    assert pick_config(64, 6144, 4096, 4, 132, 64) == QuantMatmulConfig(64, 64, 1, field_dots=False)
    assert pick_config(48, 28672, 4096, 8, 132, 32) == QuantMatmulConfig(128, 64, 1, num_warps=8, field_dots=False)
    assert pick_config(32, 28672, 4096, 4, 132, 32) == QuantMatmulConfig(64, 32, 2)
    assert pick_config(64, 4096, 14336, 4, 132, 32) == QuantMatmulConfig(64, 32, 8)     # long K: as before
    check(40, 128, 512, 4, 32, torch.float16, True, QuantMatmulConfig(64, 64, 1, field_dots=False))
    assert dense_min_rows(28672, 4096, 4, 128) == 384 and dense_min_rows(4096, 4096, 4, 256) == 384
    assert dense_min_rows(4096, 4096, 4, 64) == 65 and dense_min_rows(4096, 4096, 8, 128) == 65
    assert dense_min_rows(960, 576, 4, 128) == 65                           # a small weight
    check(100, 40, 512, 4, 128, torch.float16, True, QuantMatmulConfig(64, 64, 2))   # 2 token tiles, split


def test_split_k_is_deterministic() -> None:
    gen = torch.Generator().manual_seed(7)
    q, s, o = random_weight(32, 1024, 4, 128, gen)
    w = pack_quantized(q, s, o, 4, 128)
    x = torch.randn(2, 1024, generator=gen).half().to(DEVICE)
    cfg = QuantMatmulConfig(16, 16, 4)
    outs = []
    for _ in range(3):
        out = torch.full((2, 32), float("nan"), dtype=torch.float16, device=DEVICE)
        quant_matmul(x, w, None, out, cfg, torch.empty(4 * 2 * 32, device=DEVICE),
                     torch.zeros(8, dtype=torch.int32, device=DEVICE))
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


@pytest.mark.parametrize("bits,group,k", [(4, 32, 96), (4, 128, 640), (8, 64, 320)])
def test_pack_round_trip_and_dequantize(bits: int, group: int, k: int) -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, s, o = random_weight(21, k, bits, group, gen)
    w = pack_quantized(q, s, o, bits, group)
    assert w.padded_in_features % block_k(bits) == 0 and w.padded_in_features >= k
    assert w.words.numel() * 4 == 21 * w.padded_in_features * bits // 8
    q2, s2, o2 = unpack_quantized(w)
    assert torch.equal(q2, q) and torch.equal(s2, s) and torch.equal(o2, o)
    for dtype in (torch.float32, torch.float16):
        out = torch.full((21, k), float("nan"), dtype=dtype, device=DEVICE)
        dequantize_packed(w, out)
        want = quant_matmul_ref(torch.eye(k, device=DEVICE), q, s, o).t().to(dtype)
        assert torch.equal(out, want)


@pytest.mark.parametrize("group", [128, 256])
def test_paired_layout_holds_neighbouring_codes(group: int) -> None:
    """4 bits in groups of 128+: fields i' and i' + 4 of word 16 h + j' are codes h 128 + i' 32 + 2 j' and the
    one after it (what lets the tensor-core kernel feed one and-or to its dot with no shuffle); other
    layouts keep field i of word j = code i 32 + j."""
    k = 512
    q = (torch.arange(k) % 251).to(torch.uint8).view(1, k) % 16         # code k is k's residue: unique per block
    ones = torch.ones(1, k // group, dtype=torch.float16)
    words = pack_quantized(q, ones, ones * 0, 4, group).words[0].long() & 0xFFFFFFFF
    for b in range(2):
        for h in range(2):
            for jj in range(16):
                w = int(words[b * 32 + 16 * h + jj])
                for i in range(4):
                    kk = b * 256 + h * 128 + i * 32 + 2 * jj
                    assert (w >> (4 * i)) & 15 == int(q[0, kk]) and (w >> (4 * i + 16)) & 15 == int(q[0, kk + 1])
    plain = pack_quantized(q, torch.ones(1, k // 32, dtype=torch.float16),
                           torch.zeros(1, k // 32, dtype=torch.float16), 4, 32).words[0].long()
    assert all((int(plain[j]) >> (4 * i)) & 15 == int(q[0, i * 32 + j]) for i in range(8) for j in range(32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_one_row_x_not_4_byte_aligned(dtype: torch.dtype) -> None:
    """The one-row kernel reads two 16-bit x per 32-bit load only from 4-byte aligned rows: x as a view
    2 bytes into its storage (and a row stride of K + 1) takes the 16-bit loads, with the same result."""
    gen = torch.Generator().manual_seed(5)
    n, k = 48, 512
    q, s, o = random_weight(n, k, 4, 128, gen)
    w = pack_quantized(q, s, o, 4, 128)
    x = torch.randn(2, k + 1, generator=gen).to(dtype).to(DEVICE)[:, 1:]
    assert x.data_ptr() % 4 != 0 or x.element_size() == 4
    for rows in (x[:1], x):
        out = torch.full((rows.shape[0], n), float("nan"), dtype=dtype, device=DEVICE)
        cfg = QuantMatmulConfig(16, 1, 2)
        part = torch.full((cfg.split_k * rows.shape[0] * n,), float("nan"), device=DEVICE)
        quant_matmul(rows, w, None, out, cfg, part, torch.zeros(64, dtype=torch.int32, device=DEVICE))
        assert rel_err(out.cpu(), quant_matmul_ref(rows.cpu(), q.cpu(), s.cpu(), o.cpu())) < TOL[dtype]


def test_checks_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    q, s, o = random_weight(16, 512, 4, 32, gen)
    w = pack_quantized(q, s, o, 4, 32)
    x = torch.randn(2, 512, generator=gen).half().to(DEVICE)
    out = torch.empty(2, 16, dtype=torch.float16, device=DEVICE)
    cfg = QuantMatmulConfig(16, 16, 1)
    with pytest.raises(ValueError, match="features"):
        quant_matmul(x[:, :256], w, None, out, cfg)
    with pytest.raises(ValueError, match="out must be"):
        quant_matmul(x, w, None, out.float(), cfg)
    with pytest.raises(ValueError, match="unit stride"):
        quant_matmul(x.t().contiguous().t(), w, None, out, cfg)
    with pytest.raises(ValueError, match="split-K 2 needs"):
        quant_matmul(x, w, None, out, QuantMatmulConfig(16, 16, 2))
    with pytest.raises(ValueError, match="thread_rows"):
        quant_matmul(x, w, None, out, QuantMatmulConfig(16, 16, 1, thread_rows=True))
    q2, s2, o2 = random_weight(16, 512, 4, 128, gen)       # the pair-codes layout: 8 warps only without split-K
    with pytest.raises(ValueError, match="without split-K"):
        quant_matmul(x, pack_quantized(q2, s2, o2, 4, 128), None, out, QuantMatmulConfig(16, 16, 2, num_warps=8),
                     torch.empty(64, device=DEVICE), torch.zeros(4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="group size"):
        pack_quantized(q[:, :48], s[:, :3], o[:, :3], 4, 16)
    with pytest.raises(ValueError, match="group size"):
        pack_quantized(q[:, :192], s[:, :2], o[:, :2], 4, 96)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("T", [1, 7, 32, 64, 130, 300])
def test_gpu_8b_layer_shapes(n: int, k: int, T: int) -> None:
    check(T, n, k, 4, 128, torch.bfloat16, T == 7)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("T", [1, 8, 32, 48, 64])
def test_gpu_8b_layer_shapes_in_groups_of_32(n: int, k: int, T: int) -> None:
    """What a Q4_0 / Q4_K GGUF of an 8B runs (pair codes for groups of 32 at 2-64 rows), through pick_config's
    choice."""
    check(T, n, k, 4, 32, torch.bfloat16, T == 8)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 128), (8, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_bits_groups_dtypes(bits: int, group: int, dtype: torch.dtype) -> None:
    for T in (1, 13, 150):
        check(T, 1000, 1536, bits, group, dtype, True)
        check(T, 1536, 576, bits, group if 576 % group == 0 else 32, dtype, False)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8])
def test_gpu_split_k_under_graph_capture(T: int) -> None:
    """A captured split-K launch replays right with new inputs (no host sync, counters reset each time)."""
    gen = torch.Generator().manual_seed(3)
    q, s, o = random_weight(4096, 14336, 4, 128, gen)
    w = pack_quantized(q, s, o, 4, 128)
    x = torch.randn(T, 14336, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty(T, 4096, device=DEVICE, dtype=torch.bfloat16)
    cfg = pick_config(T, 4096, 14336, 4, 132)
    assert cfg.split_k > 1
    partials = torch.empty(cfg.split_k * T * 4096, device=DEVICE)
    locks = torch.zeros(256, dtype=torch.int32, device=DEVICE)
    quant_matmul(x, w, None, out, cfg, partials, locks)            # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quant_matmul(x, w, None, out, cfg, partials, locks)
    for _ in range(3):
        x.copy_(torch.randn(T, 14336, generator=gen).to(DEVICE, torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        assert rel_err(out, quant_matmul_ref(x, q, s, o)) < TOL[torch.bfloat16]
    assert int(locks.abs().sum()) == 0


@pytest.mark.parametrize("bits,group,split,k", [(4, 128, 1, 512), (4, 128, 3, 1024), (4, 32, 2, 384),
                                                (8, 64, 2, 384)])
def test_one_row_addend(bits: int, group: int, split: int, k: int) -> None:
    """One row with a float32 addend (a LoRA delta): added before rounding, split or not, and left zero."""
    gen = torch.Generator().manual_seed(21)
    n = 40
    q, s, o = random_weight(n, k, bits, group, gen)
    w = pack_quantized(q, s, o, bits, group)
    x = torch.randn(1, k, generator=gen).half().to(DEVICE)
    bias = torch.randn(n, generator=gen).half().to(DEVICE)
    add = torch.randn(1, n, generator=gen).to(DEVICE)
    part = torch.full((split * n,), float("nan"), device=DEVICE)
    locks = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    want = quant_matmul_ref(x, q, s, o, bias).cpu() + add.cpu()
    configs = [QuantMatmulConfig(16, 1, split)] + ([QuantMatmulConfig(32, 1, split, num_warps=1, thread_rows=True)]
                                                   if group == 32 else [])
    for cfg in configs:
        addend, out = add.clone(), torch.full((1, n), float("nan"), dtype=torch.float16, device=DEVICE)
        quant_matmul(x, w, bias, out, cfg, part, locks, addend=addend)
        assert rel_err(out.cpu(), want) < TOL[torch.float16], cfg
        assert not addend.any(), "the addend must be left all zeros"
        assert int(locks.abs().sum()) == 0
    with pytest.raises(ValueError, match="addend"):
        quant_matmul(x.repeat(2, 1), w, bias, out.repeat(2, 1), QuantMatmulConfig(16, 16, 1), None, None,
                     addend=torch.zeros(2, n, device=DEVICE))
