"""Launch choices of the quantized matmul (`kernels.quant_matmul`): the tiles, split-K and path for a shape
(`pick_config`), the layouts that decide a path, and the row count from which a GEMM on the dequantized
weight takes over (`dense_min_rows`)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kernels.host_ints import cdiv, next_pow2
from kernels.quant_pack import block_k, paired_layout


@dataclass(frozen=True)
class QuantMatmulConfig:
    block_n: int        # output features per program (>= 16)
    block_m: int        # tokens per program: 1 (the one-row kernel) or >= 16 (tensor cores)
    split_k: int        # programs sharing one output tile along K
    num_warps: int = 4
    num_stages: int = 3
    field_dots: bool = True     # tensor cores: one K=32 dot per field (else one dot per 256-wide block)
    pair_codes: bool = True     # tensor cores, 4 bits in groups of 128+, 16-bit x: codes into the dot as they
                                # are, group scales after it (`_pairs_step`); else dequantized before the dot
    thread_rows: bool = False   # one row, groups of 32: each thread holds whole rows of a block, one FMA chain
                                # a group and row (`quant_gemv._rows_step`)
    tma_stages: int = 0         # one row on the float16-pairs path: > 0 reads the words by TMA through that many
                                # pipeline stages (`kernels.quant_gemv_tma`; sm_90+, else the register-set kernel);
                                # 2+ rows on the pair-codes path: the same, a half block a stage
                                # (`kernels.quant_mma_tma`; not picked: H200, no rule won,
                                # docs/quantization-performance.md)
    scales_ahead: bool = False  # with tma_stages: each block's scales and offsets read a block ahead
    ring: int = 0               # 2-32 rows on the pair-codes path, bfloat16 x, sm_90+: > 0 runs the asynchronous-dot
                                # kernel (`kernels.quant_wgmma`: block_n 64, or 128 on two warpgroups; block_m 8 /
                                # 16 / 32, or 128 / 256 with the weights dequantized into the operand, ring_step 1)
                                # with a ring of that many half blocks, ring_step half blocks a loop step
    ring_step: int = 4


def group_pairs_layout(bits: int, group_size: int, K: int) -> bool:
    """Whether a weight suits the pair-codes path for groups of 32 (`_group_pairs_step`): 4 bits in groups of
    32 (the plain layout: a block's field i is one group) and K a multiple of 32."""
    return bits == 4 and group_size == 32 and K % 32 == 0


def pair_codes_layout(bits: int, group_size: int, K: int) -> bool:
    """Whether a weight's layout suits the pair-codes path (`_pairs_step`): the paired layout (4 bits, groups
    of 128 or more: each half block of 128 codes in one group), and K a multiple of 128 (whole halves of x
    to sum)."""
    return paired_layout(bits, group_size) and K % 128 == 0


# Weights of fewer codes (N * K) are latency-bound: their own tiles in pick_config, dense from 65 rows.
SMALL_WEIGHT = 4 * 2**20


def dense_min_rows(N: int, K: int, bits: int, group_size: int) -> int:
    """Rows from which dequantizing the weight once and running a library GEMM beats this kernel (QuantLinear's
    switch). H100 sweeps: 65 for most layouts (the fused kernel was 30-40% slower on o and down at 128 rows);
    H200 sweep of the 8B shapes on the pair-codes path: 384 (at 256 rows a layer on the tiles took 296 us
    against 389 for the GEMM, on the tiles and the 256-row asynchronous-dot tiles for gate/up 270; at 512 rows
    the GEMM 494 against 501 and 559; bench/results/quant_kernel_wide.json; an earlier sweep had the two even
    at 256 rows, bench/results/quant_kernel_big_rows.json); 4 bits
    in groups of 32 (pair codes): 129 (a layer at 96 rows 284 us against 359, at 128 rows 295 against 364, at
    192 rows 506 against 388; bench/results/quant_kernel_big_rows_g32.json)."""
    if N * K < SMALL_WEIGHT:
        return 65
    return 384 if pair_codes_layout(bits, group_size, K) else 129 if group_pairs_layout(bits, group_size, K) else 65


@functools.lru_cache(maxsize=4096)     # a pure function of its arguments; ~9 us of Python a call uncached
def pick_config(T: int, N: int, K: int, bits: int, num_sms: int, group_size: int = 128,
                x_dtype: torch.dtype = torch.bfloat16, beside_lora: bool = False,
                async_dots: bool = False, async_one_row: bool = False,
                deferred: bool = True) -> QuantMatmulConfig:
    """Kernel, tiles and split-K for a shape (bench/quant_kernel_sweep.py on an H100: the 8B layer shapes at
    group 128 and the default SmolLM2's at group 32; each rule below was the fastest or within ~10% there).

    `async_dots` (the caller's GPU runs `kernels.quant_wgmma`: sm_90+, compiled): 2-32 rows of a large 4-bit
    weight in groups of 128+ with bfloat16 x take that kernel (`_async_dots_config`, its rules and figures), and
    65+ rows of such a weight whose feature tiles alone fill the SMs twice (gate/up) its 128- and 256-row tiles
    (`_wide_config`);
    with `async_one_row` one row too where no LoRA launch runs beside it (its 8-row tile's rule; for A/B runs,
    `kernels.quant_wgmma.async_one_row_enabled`: not measured in the engine yet).
    One row of a large 4-bit weight in groups of 32 with K < 8192 (what a Q4_0 GGUF of an 8B runs): each
    thread holds two whole rows of a block (`thread_rows`, 128-feature programs of 2 warps; sm_90 machine code
    4.52 instructions a code against 7.95 for the elementwise kernel's 32-feature programs), split to about 8
    programs an SM, rounded up to a power of two, at most 16 (H200 sweep, 8B shapes, against the elementwise
    kernel's rule: q/k/v 17.1 -> 13.9 us, o 11.8 -> 11.4, gate/up 47.1 -> 46.0; down, K = 14336, stays
    elementwise: 30.6 there against 32.7; `bench/results/quant_rows32_ab.json`).
    One row of a large 4-bit weight in groups of 128 and more with bfloat16 x (the served 8B; `quant_gemv`'s
    two-register-set float16-pairs path): 128-feature programs, split to about three programs an SM or fewer
    (one wave at the in-launch sum's 168 registers; the deferred sum's 193 fit two an SM, and bounding them
    to 168 changed nothing, bench/results/gemv_maxnreg_ab.json), at most 16 (H200 sweep of the 8B shapes over
    32/64/128 features and splits 1-16, bench/results/quant_sweep_8b_rows1.json: q/k/v 7.6 us at split 8
    against 9.5 at the two-an-SM rule's 4; o and down 6.9 / 16.1 at 8, each the fastest; gate/up 28.9 at 1, the
    fastest 27.9). `beside_lora` (a LoRA
    launch runs beside the call: at one row the fused launch whose delta it adds, `quant_matmul`'s addend; at 2+
    rows the LoRA on a side stream, `LlamaModel._project`): at one row about two an SM, leaving
    room for that launch's programs (only q/k/v differs, 8 -> 4: H200 engine at batch 1, one run each, rank 16
    on every module 2.91 against 2.84 ms a token, rank 64 on q/k/v 2.65 against 2.55; with no adapter 2.39
    against 2.43, bench/results/quant_chain4_ab.json). Where the 128-feature tiles alone fill the SMs (gate/up) the
    same arithmetic reads its words by TMA (`kernels.quant_gemv_tma`), split 2, two stages, with or without a LoRA
    launch beside it (H200: gate/up 24.6-25.5 us against 28.9-30.4; the engine at batch 1 2.49 -> 2.30 ms a token,
    rank 16 on every module 3.04 -> 2.71; bench/results/quant_tma_ab.json); on q/k/v, o and down it was no faster.
    Those figures were swept with split-K's partials summed in the launch. With them left to the next kernel (the
    engine's case since 6714be1; `bench/quant_kernel_sweep.py --defer`, bench/results/quant_kernel_defer.json) and
    no LoRA launch beside: gate/up split 4 (17.3 us against 18.0-18.2 at 2), and 64-feature programs where the
    128-feature ones would make under two an SM (o and down, 256 programs: 5.2 / 11.2 us against 5.5 / 11.7;
    q/k/v keeps 128, 5.5 against 6.1). The engine at batch 1 (H200, one lease, runs interleaved,
    bench/results/one_row_rule_ab.json): 2.08 -> 2.04 ms a token, rank 64 on q/k/v 2.28 -> 2.22; beside a LoRA
    launch the same change was slower (rank 16 on every module 2.53 -> 2.78: gate/up's split 4, 2.54 -> 2.74; the
    64-feature programs even, bench/results/preread_beside_ab.json), so there the rule above holds, as it
    does where the launch sums its own partials (`deferred` False: under tensor parallelism o and down, whose
    output goes to the all-reduce, or with LORAPLEX_DEFER_SPLIT=0).
    Other one-row cases: the elementwise kernel, split until ~8 programs of 32 features per SM (the same feature
    count as ~4 programs of 64) where K has 6 blocks or more; 64 features per program for 4 bits in groups
    of 128 and more (its two-halves path: H200 sweep, each 8B shape's fastest or within 5%), else 32.
    The same kernel (a program per row) for 2-8 rows of a small weight with T * N <= 8192 (the default
    SmolLM2's q/k/v, o and down up to 8 rows, gate/up up to 2; H200: 3.4-6.0 us against 5.3-6.4 for the
    tensor-core tiles; each row reads the weight, from L2 at these sizes).
    2-64 rows on a small weight (N * K < 4M, latency-bound): one dot per 256-wide block, 32-feature tiles;
    below 6 blocks of K no split, from 6 blocks split 4. (16-feature programs of 2 warps were 10% faster
    per launch in the sweep at 1-16 rows; one run of the default model's engine decode with them was
    13-24% slower at batch 1/8, inside that benchmark's run-to-run spread: not picked until measured.)
    On a large weight: one dot per field, 64-feature tiles, split 4 (8 for a long K), none above 32 rows
    when the feature tiles alone fill the SMs. 4 bits in groups of 128+ (the pair-codes path; H200 sweeps of
    the 8B shapes at 8-64 rows, each within 10% of its best): 64-feature tiles, split 1 where the tiles
    fill the SMs twice, else 4 (8 for a long K up to 16 rows); above 16 rows split to about two programs per
    SM (q/k/v at 48-64 rows: 26.5 -> 23.0 us with split 2 instead of 4; at 32 rows 21.7 -> 18.6-19.4 us).
    Token tiles of 16 / 32 / 64 rows (32 where a long K or few feature tiles leave SMs idle).
    More than 64 rows of a large weight on the pair-codes path: the same 64 x 64 tiles and split rule (H200,
    8B shapes at 96-256 rows: the fastest of 64/128-row token tiles, 64/128-feature tiles, 4/8 warps and 2-4
    stages; QuantLinear runs it below `dense_min_rows`).
    65-128 rows of a large 4-bit weight in groups of 32 (pair codes, `_group_pairs_step`; QuantLinear runs it
    below `dense_min_rows`): 128 x 128 tiles on 8 warps where 128-feature tiles alone fill the SMs (gate/up),
    else 64 x 64, split 2 where those tiles do not fill the SMs once (H200 sweep of the 8B shapes at 96 and 128
    rows, `bench/results/quant_kernel_big_rows_g32.json`: each the fastest tried; a layer at 128 rows 295 us
    against 364 for dequantize + GEMM; at 192 rows and more the GEMM is faster).
    Other layouts above 64 rows: 128 x 64 tiles (QuantLinear dequantizes and uses a GEMM there).
    Other layouts on a large weight (groups of 32 or 64, 8 bits; H200 sweep of the 8B shapes at group 32,
    `bench/results/quant_kernel_sweep_8b_g32.json`): 33-64 rows with K < 8192 take one dot per 256-wide block
    with no split, 64-feature tiles, or 128 on 8 warps where those alone fill the SMs (64 rows: q/k/v 60.9 ->
    33.1 us, o 42.2 -> 33.6, gate/up 188.5 -> 108.4); 8-32 rows split 2 where the tiles fill the SMs twice
    (gate/up at 32 rows 112.0 -> 99.3). 4 bits in groups of 32 take pair codes (`_group_pairs_step`) wherever
    those rules pick one dot per field; at 33-64 rows with K < 8192 64 x 64 tiles, split 4 unless the tiles
    fill the SMs twice (H200, `bench/results/quant_group_pairs_ab.json`, 64 rows: o 33.2 -> 20.8 us, gate/up
    106.5 -> 90.6; q/k/v 33.3 -> 35.6, within 10%)."""
    num_blocks = -(-K // block_k(bits))

    def pow2_floor(v: int) -> int:
        return 1 << (max(1, v).bit_length() - 1)

    pairs = pair_codes_layout(bits, group_size, K)
    wide = _wide_config(T) if async_dots and T > 64 and pairs and x_dtype == torch.bfloat16 \
        and cdiv(N, 64) >= 2 * num_sms else None
    if wide is not None:
        return wide
    if async_dots and (T > 1 or async_one_row) and T <= 32 and pairs and x_dtype == torch.bfloat16 \
            and N * K >= SMALL_WEIGHT and (T > 16 or not beside_lora):
        ring = _async_dots_config(T, N, K, num_sms)
        if ring is not None:
            return ring
    if T == 1 and bits == 4 and group_size == 32 and K < 8192 and N * K >= SMALL_WEIGHT:     # whole rows a thread
        split = min(next_pow2(cdiv(8 * num_sms, cdiv(N, 128))), 16)
        return QuantMatmulConfig(128, 1, max(1, min(split, num_blocks)), num_warps=2, thread_rows=True)
    if T == 1 and paired_layout(bits, group_size) and x_dtype == torch.bfloat16 and N * K >= SMALL_WEIGHT:
        swept_deferred = deferred and not beside_lora
        if cdiv(N, 128) >= num_sms:     # gate/up: words by TMA, two stages, split 4 (else 2)
            return QuantMatmulConfig(128, 1, max(1, min(4 if swept_deferred else 2, num_blocks)), tma_stages=2)
        split = max(1, min(pow2_floor((2 if beside_lora else 3) * num_sms // cdiv(N, 128)), 16, num_blocks))
        narrow = swept_deferred and cdiv(N, 128) * split < 2 * num_sms     # o, down
        return QuantMatmulConfig(64 if narrow else 128, 1, split)
    if T == 1 or (N * K < SMALL_WEIGHT and T * N <= 8192):     # one row, or a few rows of a small weight
        bn = 64 if paired_layout(bits, group_size) else 32          # the two-halves path reads 64 well
        if num_blocks < 6:      # short K: no split
            return QuantMatmulConfig(bn, 1, 1)
        per_sm = 256 * num_sms // bn            # 8 programs of 32 features (4 of 64) per SM, over the T rows
        return QuantMatmulConfig(bn, 1, min(pow2_floor(min(per_sm // (triton.cdiv(N, bn) * T), 16)), num_blocks))
    if T > 64 and N * K >= SMALL_WEIGHT and group_pairs_layout(bits, group_size, K):
        if cdiv(N, 128) >= num_sms:
            return QuantMatmulConfig(128, 128, 1, num_warps=8)
        return QuantMatmulConfig(64, 64, 1 if cdiv(N, 64) * cdiv(T, 64) >= num_sms else 2)
    if T > 64 and not pairs:
        return QuantMatmulConfig(128, 64, 1, num_warps=8)
    block_m = 16 if T <= 16 else 32 if T <= 32 else 64
    if N * K < SMALL_WEIGHT:
        if num_blocks >= 6:     # longer K: split 4
            return QuantMatmulConfig(32, min(block_m, 32), 4, field_dots=False)
        block_m = min(block_m, 32) if triton.cdiv(N, 32) < 64 else block_m
        return QuantMatmulConfig(32, block_m, 1, field_dots=False)
    tiles = triton.cdiv(N, 64) * triton.cdiv(T, block_m)
    if pairs:
        split = 1 if tiles >= 2 * num_sms else 8 if K >= 8192 and T <= 16 else 4
        if T > 16 and split > 1:        # 32- and 64-row tiles: about 2 programs per SM (q/k/v: split 2)
            split = pow2_floor(2 * num_sms // tiles)
        return QuantMatmulConfig(64, block_m, max(1, min(split, num_blocks // 3)))
    if T > 32 and K < 8192 and group_pairs_layout(bits, group_size, K):    # 33-64 rows, pair codes: 64 x 64
        return QuantMatmulConfig(64, 64, 1 if tiles >= 2 * num_sms else 4)
    if T > 32 and K < 8192:     # 33-64 rows: one dot per 256-wide block, no split
        wide = triton.cdiv(N, 128) >= num_sms
        return QuantMatmulConfig(128 if wide else 64, 64, 1, num_warps=8 if wide else 4, field_dots=False)
    block_m = min(block_m, 32) if K >= 8192 else block_m
    tiles = triton.cdiv(N, 64) * triton.cdiv(T, block_m)
    split = 1 if T > 32 and tiles >= num_sms else 2 if tiles >= 2 * num_sms else 8 if K >= 8192 else 4
    return QuantMatmulConfig(64, block_m, max(1, min(split, num_blocks // 3)))


def _wide_config(T: int) -> QuantMatmulConfig | None:
    """65+ rows of a 4-bit weight in groups of 128+ whose 64-feature tiles alone fill the SMs twice (gate/up) with
    bfloat16 x on sm_90+: the asynchronous-dot kernel on 128-row tiles of 64 features, or at 193-256 rows one
    256-row tile of 128 (two warpgroups), its weights dequantized into the dot's operand, a ring of 3, no split;
    None at 129-192 rows (the pair-codes tiles: a 256-row tile would be a quarter empty or more). H200 sweep of the
    8B shapes at 128 / 192 / 256 / 384 / 512 rows (`bench/quant_kernel_sweep.py --wide`,
    bench/results/quant_kernel_wide.json), gate/up against the tiles: 89.6 -> 83.3 us at 128 rows, 157.7 ->
    132.1 at 256, 239.4 -> 221.4 at 384, 311.4 -> 262.7 at 512; at 192 the tiles 129.6 against 135.7. On q/k/v,
    o and down the tiles were as fast or faster (down at 128 rows 46.5 against 43.8 with the sums' launch the
    tiles need and the engine's norms write anyway)."""
    if T <= 128:
        return QuantMatmulConfig(64, 128, 1, ring=3, ring_step=1)
    if T <= 192:
        return None
    if T <= 256:
        return QuantMatmulConfig(128, 256, 1, ring=3, ring_step=1)
    return QuantMatmulConfig(64, 128, 1, ring=3, ring_step=1)


def _async_dots_config(T: int, N: int, K: int, num_sms: int) -> QuantMatmulConfig | None:
    """2-32 rows of a large 4-bit weight in groups of 128+ with bfloat16 x on sm_90+ (`async_dots`): the
    asynchronous-dot kernel (`kernels.quant_wgmma`), 64 features by 8 / 16 / 32 rows a program. Where the
    feature tiles alone fill the SMs twice (gate/up) no split, a ring of 6 half blocks taken 2 a step; else up to
    8 rows split 4, a ring of 4 taken 4 a step (a long K: split 8, a ring of 8 taken 2), 9-16 rows the same but
    a long K (down) takes 128 features, split 4, a ring of 8 taken 2; above 16 rows
    split 4 unless that makes more than two programs an SM (then none, a ring of 6 taken 2). At 9-16 rows gate/up
    and down run 128 features a program (two warpgroups sharing each copy of x): 16 rows, SYNC 1, gate/up 28.5 us
    against 30.3 on the 64-feature config picked before, down 17.7 against the tiles' 19.8; on q/k/v and o, and
    at 8 or 32 rows, 128 features were no faster (bench/results/quant_async_dots_rows1_8_16.json,
    _rows32_64.json; the engine at batch 16, no adapter: 2.79 against 2.92 ms a token). H200 sweep of the 8B
    shapes at 1-64 rows against the tiles above (`bench/quant_async_dots.py`, the split-K sums in order,
    bench/results/quant_async_dots.json). At one row the kernel was even with the one-row kernel, and at 64 rows
    gate/up and down slower than the tiles (gate/up 64.2 us against 47.4). A split or step that does not divide
    K's half blocks steps down; None where nothing does. Not at 2-16 rows beside a LoRA launch (`beside_lora`: the
    LoRA on a side stream): the 8B engine with rank-16 adapters on every module, each request its own, took 3.95 /
    4.56 ms a token at batch 8 / 16 against 3.56 / 4.25 with the tiles (at 32, 4.80 against 4.75; rank 64 on
    q/k/v 4.28 against 4.54; H200, bench/results/quant_decode_async_dots{,_off}.json)."""
    halves = K // 128
    block_m = 8 if T <= 8 else 16 if T <= 16 else 32
    tiles = cdiv(N, 64) * cdiv(T, block_m)
    long_k = K >= 8192
    block_n = 64
    if cdiv(N, 64) >= 2 * num_sms:
        split, ring, step = 1, 6, 2
        block_n = 128 if 8 < T <= 16 else 64        # gate/up at 9-16 rows: two warpgroups share x
    elif T <= 16:
        if long_k and T > 8:        # down at 9-16 rows: 128 features, split 4, a ring of 8 taken 2
            split, ring, step, block_n = 4, 8, 2, 128
        else:
            split, ring, step = (8, 8, 2) if long_k else (4, 4, 4)
    elif 4 * tiles > 2 * num_sms:
        split, ring, step = 1, 6, 2
    else:
        split, ring, step = 4, 4, 4
    for sp in (split, split // 2, split // 4, 1):
        for st, rg in ((step, ring), (2, max(ring, 6))):
            if sp >= 1 and halves % (sp * st) == 0:
                return QuantMatmulConfig(block_n, block_m, sp, ring=rg, ring_step=st)
    return None
