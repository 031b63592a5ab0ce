"""Weight-only quantized matmul (W4A16 / W8A16): out = x @ dequant(W).T, reading the packed codes in place.

Kernels of one family, all reading `kernels.quant_pack`'s layout (per K block, 32 int32 words per
row; field i of the words holds 32 consecutive codes of one group, or, in the paired layout of 4 bits in
groups of 128+, 32 codes of one half block, two neighbours a word):

- Tensor-core kernel (2+ rows, `kernels.quant_mma`): a program owns BLOCK_N features by BLOCK_M tokens
  and a range of K blocks; the weight dequantized in registers, or (4 bits in groups of 128+ with
  16-bit x) the codes fed to the dots as they are, the group scales applied to the dots' sums.
- Asynchronous-dot kernel (2-32 rows of a large 4-bit weight in groups of 128+, bfloat16 x, sm_90+:
  `kernels.quant_wgmma`, where pick_config is given `async_dots`): the pair codes fed to tensor-core dots that
  run while the next half block is unpacked, everything a half block needs copied ahead into a shared ring.
- One-row kernel (batch-1 decode, `kernels.quant_gemv`): no tensor cores, codes * x elementwise in fp32 (in
  float16 pairs for bfloat16 x on 4 bits in groups of 128+, `kernels.quant_h2`); for gate/up-sized weights on
  sm_90+ the float16-pairs arithmetic with its words read by TMA (`kernels.quant_gemv_tma`).

Split-K (decode: few output tiles for 132 SMs, e.g. the down projection N=4096, K=14336) is
`kernels.quant_split`: the last program of a tile sums the partials, in the same launch, or with `defer_split`
the kernel that reads the output next does (`kernels.split_sum`).
For many rows, `kernels.quant_dequant.dequantize_packed` writes the dense weight for a library GEMM.
Which kernel, tiles and split a shape takes: `kernels.quant_config`.
"""
from __future__ import annotations

import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.env_switch import env_int
from kernels.pdl import compiled, launch_args, pdl_enabled
from kernels.quant_config import (QuantMatmulConfig, dense_min_rows, group_pairs_layout,  # noqa: F401
                                  pair_codes_layout, pick_config)
from kernels.quant_gemv import quant_gemv_kernel
from kernels.quant_gemv_tma import quant_gemv_tma_kernel
from kernels.quant_mma_tma import quant_mma_tma_kernel
from kernels.quant_h2 import fp16_pairs_enabled
from kernels.quant_half_sums import check_sums, half_sums_into
from kernels.quant_mma import quant_mma_kernel
from kernels.quant_pack import PackedQuantWeight, block_k, paired_layout
from kernels.quant_split import DEFER
from kernels.quant_wgmma import BLOCK_NS, DEQ_ROWS, quant_wgmma, runs_on


def _quad_words(w: PackedQuantWeight) -> bool:
    """The words' layout gives a thread 4 consecutive words of a row (16-byte reads: rows of a multiple of 16 words,
    16-byte aligned), which `kernels.quant_h2.h2_acc4`'s packs of 4 assume (otherwise its packs would group other
    elements, silently). Packed rows always hold a multiple of 16 words (`kernels.quant_pack`, 4 bits); words
    that do not start 16-byte aligned (a view at an odd offset) take the fp32 path."""
    return w.words.shape[1] % 16 == 0 and w.words.data_ptr() % 16 == 0


def quant_matmul(
    x: torch.Tensor,                 # [T, K] float16 / bfloat16 / float32, unit stride along K
    w: PackedQuantWeight,            # [N, K] packed (kernels.quant_pack)
    bias: torch.Tensor | None,       # [N] or None
    out: torch.Tensor,               # [T, N] contiguous, x's dtype
    config: QuantMatmulConfig,
    partials: torch.Tensor | None = None,   # float32, >= split_k * T * N elements (split_k > 1 only)
    locks: torch.Tensor | None = None,      # int32 zeros, >= cdiv(N, block_n) * cdiv(T, block_m) (split_k > 1)
    addend: torch.Tensor | None = None,     # [T, N] float32 contiguous, one-row kernel only (block_m == 1)
    x_sums: torch.Tensor | None = None,     # [T, K / width] float32: x's slice sums, where `sums_width` > 0
    defer_split: bool = False,              # split > 1: partials only (`kernels.split_sum`), out not written
) -> None:
    """Semantics (fp32 accumulation; IEEE fp32 products for float32 x):
        W = q * scales[:, k // G] + offsets[:, k // G]          # [N, K] in fp32, q unpacked from w.words
        out[:] = (x.float() @ W.to(x.dtype).float().T + (bias.float() if bias is not None else 0)).to(x.dtype)
    The tensor-core kernel (block_m >= 16) rounds W to x's dtype once before its dot (bf16: relative
    2**-9 per weight), except on the pair-codes path (4 bits, groups of 128+, K % 128 == 0, 16-bit x),
    which like the one-row kernel (block_m == 1) keeps W in fp32: the scales apply to the fp32 sums (its
    offsets' part as a 3xTF32 dot, about fp32's precision). One exception to fp32 products: the one-row kernel
    on the paired layout (4 bits, groups of 128+) with bfloat16 x sums each word's 8 codes times x in float16
    pairs (`kernels.quant_h2`: relative ~2e-3 before the output's rounding; exact range |x| < 2**15; not with
    LORAPLEX_FP16_PAIRS=0).
    `locks` must hold zeros before the call and holds zeros after it.
    `x_sums`: the sums of x over each `sums_width(config, w, x.dtype)`-wide slice, written by the kernel that
    wrote x (`kernels.rms_norm.add_rms_norm`, `kernels.silu_mul.silu_mul`); without them (or where that width
    is 0, ignored) a launch of `kernels.quant_half_sums` computes what the call needs.
    `defer_split` (where the launch splits K, `launch_split` > 1): `out` is not written; `partials`, as
    [split, T, N], hold the fp32 terms whose sum in that order is out before rounding (the first with the bias and
    the addend), for `kernels.split_sum.SplitSum`; `locks` are not used.
    With an `addend` (one-row kernel) out also adds it before rounding, and it is left all zeros. The
    kernel is then meant to follow the launch that wrote the addend (the LoRA delta, into zeros): it reads
    x and the whole weight before waiting for that launch (kernels/pdl.py) and waits only to add it, so
    the caller guarantees that no kernel since x was written wrote anything this one reads but the addend.
    """
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be [T, K] float16/bfloat16/float32 with unit stride along K, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")
    T, K = x.shape
    N = w.out_features
    if K != w.in_features:
        raise ValueError(f"x has {K} features, the weight takes {w.in_features}")
    if out.shape != (T, N) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [{T}, {N}] of dtype {x.dtype}, got {out.dtype} {tuple(out.shape)}")
    if w.words.dtype != torch.int32 or not w.words.is_contiguous() or w.scales.dtype != torch.float16 \
            or not w.scales.is_contiguous() or not w.offsets.is_contiguous() or w.scales.shape != w.offsets.shape:
        raise ValueError("packed weight must be contiguous int32 words and float16 [groups, N] scales/offsets")
    if bias is not None and (bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{N}], got {tuple(bias.shape)}")
    cfg = config
    if cfg.block_n < 16 or not (cfg.block_m == 1 or cfg.block_m >= 16 or cfg.ring and cfg.block_m == 8) \
            or cfg.split_k < 1:
        raise ValueError(f"bad config {cfg}: block_n >= 16, block_m 1 (one row per program) or >= 16 (8 with a ring), "
                         "split_k >= 1")
    if cfg.thread_rows and (cfg.block_m != 1 or w.group_size != 32):
        raise ValueError(f"bad config {cfg}: thread_rows is the one-row kernel's path for groups of 32")
    if addend is not None and (cfg.block_m != 1 or addend.dtype != torch.float32 or addend.numel() != T * N
                               or not addend.is_contiguous()):
        raise ValueError(f"an addend takes the one-row kernel (block_m 1) and contiguous float32 [{T}, {N}], got "
                         f"block_m {cfg.block_m}, {addend.dtype} {tuple(addend.shape)}")
    num_blocks = w.padded_in_features // block_k(w.bits)
    per_split = _blocks_per_split(cfg, w)
    split = launch_split(cfg, w)
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(T, cfg.block_m), split)
    mode = 0 if split == 1 else DEFER if defer_split else 1       # `write_out`'s SPLIT
    if split > 1:
        if partials is None or partials.dtype != torch.float32 or partials.numel() < split * T * N:
            raise ValueError(f"split-K {split} needs float32 partials of >= {split * T * N} elements")
        if not defer_split and (locks is None or locks.dtype != torch.int32 or locks.numel() < grid[0] * grid[1]):
            raise ValueError(f"split-K needs int32 zero locks of >= {grid[0] * grid[1]} elements")
    if T == 0 or N == 0:
        return
    width = sums_width(cfg, w, x.dtype)
    pairs = width > 0
    if pairs and split > 1 and cfg.num_warps > 4:
        raise ValueError(f"bad config {cfg}: the pair-codes tiles on more than 4 warps run without split-K only "
                         "(split-K there made an illegal memory access on an H200; not diagnosed)")
    paired = paired_layout(w.bits, w.group_size)    # without the pair-codes path: one dot per block
    if not pairs:
        x_sums = out
    elif x_sums is None:    # sum of x over each 128-wide half block (32-wide group), once per call (`_offsets_term`)
        x_sums = half_sums(x, width)
    else:
        check_sums(x_sums, T, K, width, "x_sums")
    if cfg.ring:            # the asynchronous-dot kernel (`kernels.quant_wgmma`)
        if not ((pairs or wide_ring(cfg)) and pair_codes_layout(w.bits, w.group_size, K) and x.dtype == torch.bfloat16
                and paired and runs_on(x.device)) or cfg.block_n not in BLOCK_NS:     # the rest: quant_wgmma
            raise ValueError(f"bad config {cfg}: a ring runs 64- or 128-feature tiles of the asynchronous-dot kernel: "
                             "4 bits in groups of 128+, bfloat16 x, a compiled sm_90+ GPU")
        quant_wgmma(x, w, bias, out, x_sums, cfg.block_m, cfg.split_k, cfg.ring, cfg.ring_step, partials, locks,
                    cfg.block_n, defer=defer_split)
        return
    buffers = (x, w.words, w.scales, w.offsets, bias if bias is not None else out, out,
               partials if split > 1 else out, locks if mode == 1 else out)
    sizes = (T, N, K, x.stride(0), out.stride(0), w.words.shape[1], per_split, num_blocks, split)
    even_k = K % block_k(w.bits) == 0
    asm = compiled()                                   # fences and inline assembly: not interpreted
    pdl = launch_args(pdl_enabled(x.device))
    if cfg.block_m == 1:
        x32 = (paired or cfg.thread_rows) and x.element_size() == 2 and x.data_ptr() % 4 == 0 and x.stride(0) % 2 == 0
        h2 = paired and x32 and x.dtype == torch.bfloat16 and _quad_words(w) and fp16_pairs_enabled()
        stages, ahead = tma_override() or (cfg.tma_stages, cfg.scales_ahead)
        if h2 and stages > 0 and _tma_capable(x):
            quant_gemv_tma_kernel[grid](x, _words_desc(w, cfg.block_n), w.words, *buffers[2:],
                                        addend if addend is not None else out, *sizes, GROUP=w.group_size,
                                        BLOCK_N=cfg.block_n, SPLIT=mode, HAS_BIAS=bias is not None,
                                        EVEN_K=even_k, FENCE=asm, NUM_THREADS=32 * cfg.num_warps, ASM=asm,
                                        ADD=addend is not None, STAGES=stages, SCALES_AHEAD=ahead,
                                        num_warps=cfg.num_warps, **pdl)
            return
        quant_gemv_kernel[grid](*buffers, addend if addend is not None else out, *sizes, GROUP=w.group_size,
                                BITS=w.bits, BLOCK_N=cfg.block_n, SPLIT=mode, HAS_BIAS=bias is not None,
                                EVEN_K=even_k, FENCE=asm, NUM_THREADS=32 * cfg.num_warps, ASM=asm,
                                ADD=addend is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                PAIRED=paired, X32=x32, ROWS=cfg.thread_rows, H2=h2,
                                EVEN_N=h2 and N % cfg.block_n == 0, **pdl)
    else:
        stages = _tile_stages(cfg) if pairs and paired else 0
        if stages > 0 and _tma_capable(x):      # the words by TMA, a half block a step (`kernels.quant_mma_tma`)
            quant_mma_tma_kernel[grid](x, _words_desc(w, cfg.block_n, 16), *buffers[1:], x_sums, K // 128, *sizes,
                                       GROUP=w.group_size, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, SPLIT=mode,
                                       HAS_BIAS=bias is not None, EVEN_K=even_k, FENCE=asm,
                                       NUM_THREADS=32 * cfg.num_warps, ASM=asm,
                                       SCALE_WORDS=N % 2 == 0 and w.scales.data_ptr() % 4 == 0, STAGES=stages,
                                       num_warps=cfg.num_warps, **pdl)
            return
        quant_mma_kernel[grid](*buffers, x_sums, K // (128 if paired else 32), *sizes, GROUP=w.group_size, BITS=w.bits,
                               BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, SPLIT=mode, HAS_BIAS=bias is not None,
                               EVEN_K=even_k, IEEE=x.dtype == torch.float32, FENCE=asm,
                               NUM_THREADS=32 * cfg.num_warps,
                               FIELD_DOTS=cfg.field_dots and not paired, PAIRS=pairs, ASM=asm,
                               PAIRED=paired, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                               SCALE_WORDS=pairs and paired and N % 2 == 0 and w.scales.data_ptr() % 4 == 0,
                               **pdl)


def launch_split(config: QuantMatmulConfig, w: PackedQuantWeight) -> int:
    """The programs a launch with this config splits K over (the partials' first axis): the config's split_k,
    fewer where the weight has fewer blocks or the last would get none (not on the asynchronous-dot kernel)."""
    if config.ring:
        return config.split_k
    num_blocks = w.padded_in_features // block_k(w.bits)
    return -(-num_blocks // _blocks_per_split(config, w))     # no program left without a block


def _blocks_per_split(config: QuantMatmulConfig, w: PackedQuantWeight) -> int:
    """K blocks a split program of the one-row kernels and the tiles takes (the last may take fewer)."""
    num_blocks = w.padded_in_features // block_k(w.bits)
    return -(-num_blocks // min(config.split_k, num_blocks))


def wide_ring(config: QuantMatmulConfig) -> bool:
    """Whether a config runs the asynchronous-dot kernel on tiles of 128+ rows (weights dequantized into its
    operand: no sums of x read)."""
    return config.ring > 0 and config.block_m >= DEQ_ROWS


def sums_width(config: QuantMatmulConfig, w: PackedQuantWeight, x_dtype: torch.dtype) -> int:
    """The width of the slices of x whose sums a call with this config reads (128: the paired layout's half blocks,
    32: groups of 32), or 0 where it reads none (the pair-codes paths' offsets term, `kernels.quant_mma`; not the
    asynchronous-dot kernel's wide tiles, `wide_ring`, whose operand holds the offsets)."""
    K = w.in_features
    pairs = (config.block_m > 1 and config.pair_codes and config.field_dots and x_dtype != torch.float32
             and (pair_codes_layout(w.bits, w.group_size, K) or group_pairs_layout(w.bits, w.group_size, K))
             and not wide_ring(config))
    return (128 if paired_layout(w.bits, w.group_size) else 32) if pairs else 0


TMA_ENV = "LORAPLEX_H2_TMA"


def tma_override() -> tuple[int, bool] | None:
    """LORAPLEX_H2_TMA (for A/B runs of the engine): unset, None (each config's own `tma_stages`, pick_config's
    choice); 0, the register-set kernel everywhere; stages[,1], the one-row float16-pairs path reads its words
    by TMA through that many stages everywhere (`kernels.quant_gemv_tma`), with ",1" the scales a block ahead."""
    raw = os.environ.get(TMA_ENV, "").strip()
    if not raw:
        return None
    parts = raw.split(",")
    try:
        stages = int(parts[0])
        ahead = len(parts) > 1 and parts[1].strip() not in ("", "0")
    except ValueError:
        raise ValueError(f"{TMA_ENV} must be 0 or 'stages' or 'stages,1' (e.g. 2 or 3,1), got {raw!r}") from None
    if stages != 0 and not 2 <= stages <= 8:
        raise ValueError(f"{TMA_ENV}: stages must be 0 (off) or 2-8, got {stages}")
    return stages, ahead


TILE_TMA_ENV = "LORAPLEX_TILE_TMA"


def tile_tma_override() -> int | None:
    """LORAPLEX_TILE_TMA (for A/B runs of the engine): unset, None (each config's own `tma_stages`: pick_config's
    tiles never ask for it); 0, the register-set tiles everywhere; 2-8, every pair-codes tile launch (2+ rows, 4
    bits in groups of 128+, 16-bit x) reads its words by TMA a half block a stage through that many stages
    (`kernels.quant_mma_tma`; sm_90+)."""
    return env_int(TILE_TMA_ENV, lambda v: v == 0 or 2 <= v <= 8, "0 (off) or a number of stages 2-8")


def _tile_stages(cfg: QuantMatmulConfig) -> int:
    """The stages a 2+-row pair-codes launch with this config reads its words by TMA through (0: the register-set
    tiles): LORAPLEX_TILE_TMA where set, else the config's."""
    override = tile_tma_override()
    return cfg.tma_stages if override is None else override


def _tma_capable(x: torch.Tensor) -> bool:
    """Whether x's device reads by TMA (sm_90 and later; the interpreter emulates it on the CPU)."""
    return not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] >= 9


def _words_desc(w: PackedQuantWeight, block_n: int, width: int = 32) -> TensorDescriptor:
    """The words' TMA descriptor with [block_n, width] boxes (a block of block_n rows, or with width 16 a half
    block; made per call, a few host microseconds, so that no cache holds weights alive)."""
    return TensorDescriptor.from_tensor(w.words, [block_n, width])


def half_sums(x: torch.Tensor, width: int = 128) -> torch.Tensor:
    """[T, K / width] float32: the sums of x [T, K] over each 128-wide half block (width 32: each group of 32),
    the pair-codes paths' offsets term (`_offsets_term`), by a dependent launch (`kernels.quant_half_sums`)."""
    out = torch.empty(x.shape[0], x.shape[1] // width, dtype=torch.float32, device=x.device)
    half_sums_into(x, out, width)
    return out


__all__ = ["QuantMatmulConfig", "dense_min_rows", "half_sums", "launch_split", "pair_codes_layout", "pick_config",
           "quant_matmul", "sums_width"]
