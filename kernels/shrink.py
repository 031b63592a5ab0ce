"""LoRA shrink (SGMV): s[i, t, :r] = x[t] @ A[a(t), layer, module_i].T, reading A in place from pages.

One launch covers every slice and every adapter of the batch, whatever their
ranks. Grid: (slices x rank blocks x K splits, token tiles). A program maps its
tile to a segment (one adapter) on the device, reads that adapter's rank and
row offsets, and exits at once when the tile, the rank block or the module is
empty, so tokens without adapter and unused slots launch no work. Decode
(few tokens per adapter) splits the reduction over H_in and adds partial sums
atomically into a zeroed fp32 output; prefill keeps the whole reduction in one
program and stores.

What an adapter costs follows its own rank more than the pool's largest: rank
blocks are at most 64 rows, at decode one program a slice and split walks its
adapter's blocks (the grid of a pool of rank 64; at prefill a program per block,
those past an adapter's rank exiting at once), and an adapter
of rank <= SMALL_R (16) in a pool of larger ranks takes tiles of 16 rows
(docs/kernels.md, "Adapters smaller than the pool's largest rank").
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.host_ints import cdiv, next_pow2
from kernels.meta import LoraBatchMeta
from kernels.paged import LoraRowTables
from kernels.pdl import launch_args, pdl_enabled, wait_then_release
from kernels.tiles import segment_tile, shrink_tile

MAX_SLICES = 4
DECODE_MAX_TOKENS = 128  # at or below this many tokens the split-K (decode) configuration is used
SMALL_RANK = 16          # adapters of at most this rank take tiles of this many rows in a pool of larger ranks
MAX_RANK_BLOCK = 64      # rank rows a tile holds at most; a larger rank takes further blocks
WALK_MAXNREG = 152       # registers a 16-bit decode shrink that walks rank blocks may hold: the one-block kernel's
                         # (sm_90, scripts/kernel_sass.py; 192 unbounded, no spills at 152)


@triton.jit
def _shrink_kernel(
    x_ptr, x_stride, pool_ptr, a_off_ptr, ranks_ptr, out_ptr, out_stride_s, out_stride_t,
    tok_ptr, seg_starts_ptr, seg_slots_ptr, max_slots,
    layer, num_layers, num_modules, max_rank, K, K_PER_SPLIT,
    mod0, mod1, mod2, mod3,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    MAX_SEGS: tl.constexpr, EVEN_K: tl.constexpr, R_BLOCKS: tl.constexpr, USE_PDL: tl.constexpr,
    ROW_ALIGN: tl.constexpr, IEEE: tl.constexpr, SMALL_R: tl.constexpr, WALK_R: tl.constexpr = False,
):
    # With programmatic dependent launch (kernels/pdl.py) the step's metadata (segments, tokens, ranks, row
    # offsets) is read before the wait for the previous kernel, x and A after it; every path waits before
    # it exits.
    # Slice / rank block / K split vary fastest, so programs sharing a token tile run together and
    # the tile of x is read from DRAM once, then from L2. WALK_R (decode, one rank-block program a slice and
    # split): the program walks its adapter's further rank blocks itself.
    pid_sub = tl.program_id(0)
    pid_tile = tl.program_id(1)
    slice_id = pid_sub // (R_BLOCKS * SPLIT_K)
    pid_rk = pid_sub % (R_BLOCKS * SPLIT_K)
    num_tiles, seg, m_start, seg_end = segment_tile(pid_tile, seg_starts_ptr, max_slots, BLOCK_M, MAX_SEGS)
    if pid_tile >= num_tiles:
        wait_then_release(USE_PDL)
        return
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    module = tl.where(slice_id == 0, mod0, tl.where(slice_id == 1, mod1, tl.where(slice_id == 2, mod2, mod3)))
    entry = (slot * num_layers + layer) * num_modules + module
    # Rank, row offsets and token ids are independent loads: issue them together, then branch.
    rank = tl.load(ranks_ptr + entry)
    r_first = (pid_rk // SPLIT_K) * BLOCK_R
    offs_rb = tl.arange(0, BLOCK_R)
    rows = tl.load(a_off_ptr + entry * max_rank + r_first + offs_rb, mask=r_first + offs_rb < max_rank, other=0)
    rows = tl.multiple_of(rows, ROW_ALIGN)       # lets the compiler issue 16-byte loads along each row
    offs_s = tl.arange(0, SMALL_R)
    if SMALL_R < BLOCK_R:                        # a small adapter's rows
        rows_s = tl.multiple_of(tl.load(a_off_ptr + entry * max_rank + offs_s), ROW_ALIGN)
    else:
        rows_s = rows
    offs_m = m_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    toks = tl.load(tok_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)                  # [BLOCK_M]
    wait_then_release(USE_PDL)
    if r_first >= rank:
        return
    k_lo = (pid_rk % SPLIT_K) * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    out_row = out_ptr + slice_id * out_stride_s + toks[:, None] * out_stride_t
    if (SMALL_R < BLOCK_R) & (rank <= SMALL_R):
        # An adapter of rank <= SMALL_R in a pool of larger ranks: tiles of its size, not the pool's.
        s_mask = offs_s < rank
        acc_s = shrink_tile(x_ptr, x_stride, toks, m_mask, pool_ptr, rows_s, s_mask, k_lo, k_hi, K,
                            BLOCK_M, SMALL_R, BLOCK_K, EVEN_K, IEEE)                        # [BLOCK_M, SMALL_R]
        _store_sums(out_row + offs_s[None, :], acc_s, m_mask[:, None] & s_mask[None, :], SPLIT_K)
    else:
        if WALK_R:
            # Each block of its adapter's rank in turn, through the same code (x's tile again, from L2), the
            # next block's rows requested before this block's sums.
            for r0 in range(0, rank, BLOCK_R):
                r_mask = r0 + offs_rb < rank
                nxt = r0 + BLOCK_R + offs_rb
                rows_next = tl.load(a_off_ptr + entry * max_rank + nxt, mask=nxt < rank, other=0)
                acc = shrink_tile(x_ptr, x_stride, toks, m_mask, pool_ptr, rows, r_mask, k_lo, k_hi, K,
                                  BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, IEEE)
                _store_sums(out_row + r0 + offs_rb[None, :], acc, m_mask[:, None] & r_mask[None, :], SPLIT_K)
                rows = tl.multiple_of(rows_next, ROW_ALIGN)
        else:
            # This program's rank block.
            r_mask = r_first + offs_rb < rank
            acc = shrink_tile(x_ptr, x_stride, toks, m_mask, pool_ptr, rows, r_mask, k_lo, k_hi, K,
                              BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, IEEE)                     # [BLOCK_M, BLOCK_R]
            _store_sums(out_row + r_first + offs_rb[None, :], acc, m_mask[:, None] & r_mask[None, :], SPLIT_K)


@triton.jit
def _store_sums(ptrs, acc, mask, SPLIT_K: tl.constexpr):
    """Whole sums are stored; a K split's partial sums are added into the zeroed output."""
    if SPLIT_K == 1:
        tl.store(ptrs, acc, mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")


def rank_block(max_rank: int) -> int:
    """Rank rows of the LoRA kernels' tiles in a pool of largest rank `max_rank`: that rank padded to a power
    of two (at least 16, for `tl.dot`), at most MAX_RANK_BLOCK."""
    return min(MAX_RANK_BLOCK, max(16, next_pow2(max_rank)))


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured (then host-side shortcuts must not drop launches)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # interpreter: keep the grid small


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def shrink_config(T: int, K: int, max_rank: int, num_slices: int, max_slots: int, device: torch.device
                  ) -> dict[str, int]:
    """Block sizes and K split for a launch; depends only on host-known shapes (graph-stable).

    The reduction over H_in is split until the launch has about four programs per
    SM (counting the upper bound of token tiles), so few-token batches and long
    reductions (down_proj) still spread over the whole GPU.
    """
    block_r = rank_block(max_rank)
    r_blocks = cdiv(max_rank, block_r)
    if T <= DECODE_MAX_TOKENS:
        # Two warps and K steps of 128 at every rank (bench/lora_step_sweep.py, H200, an 8B's 32 layers, 64 tokens
        # of distinct adapters): rank 16 in a pool of 16 1164 -> 1022 us (K steps of 256 before), in a pool of 64
        # 1234 -> 1005, of 256 1873 -> 1613 (4 warps before); rank 64 in a pool of 64 3126 -> 3140.
        block_m, block_k, num_warps, min_k_split = 16, 128, 2, 256
    elif T <= 1024:
        block_m, block_k, num_warps, min_k_split = 32, (256 if block_r <= 32 else 128), 4, 512
    else:
        block_m, block_k, num_warps, min_k_split = 128, 64, 8, 512
    # Decode in a pool of ranks above one block: one program a slice and split walks its adapter's rank blocks
    # (WALK_R), so the grid is the one a pool of rank 64 gets; with a program per rank block, those past a
    # rank-16 adapter's (three in four in a pool of 256) waited for the previous kernel and exited, which cost
    # its shrink 1.6x its pool-64 time (bench/results/lora_step_sweep_pool256.json against
    # lora_step_sweep.json, 64 tokens: 1600 against 1007 us a step).
    walk_r = T <= DECODE_MAX_TOKENS and r_blocks > 1
    if walk_r:
        r_blocks = 1
    tiles = cdiv(T, block_m) + min(max_slots, T)
    programs = tiles * num_slices * r_blocks
    split_k = max(1, min(cdiv(4 * _num_sms(device), programs), K // min_k_split))
    k_per_split = cdiv(cdiv(K, split_k), block_k) * block_k
    split_k = cdiv(K, k_per_split)
    return dict(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split_k,
                K_PER_SPLIT=k_per_split, R_BLOCKS=r_blocks, WALK_R=int(walk_r), num_warps=num_warps, num_stages=3)


def check_input(x: torch.Tensor, pool: torch.Tensor) -> None:
    """Checks the activations shrink-like kernels read."""
    if x.dtype != pool.dtype:
        raise ValueError(f"x dtype {x.dtype} differs from pool dtype {pool.dtype}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be 2-D with contiguous rows (stride(1) == 1)")


def check_slices(y: torch.Tensor, slice_offsets: Sequence[int], num_slices: int, pool: torch.Tensor,
                 float32_ok: bool = False) -> list[int]:
    """Checks the output of expand-like kernels and returns the slice boundaries as ints (y in the pool's
    dtype, or float32 where the kernel takes it: `float32_ok`)."""
    if y.dtype != pool.dtype and not (float32_ok and y.dtype == torch.float32):
        raise ValueError(f"y dtype {y.dtype} differs from pool dtype {pool.dtype}")
    if y.dim() != 2 or y.stride(1) != 1:
        raise ValueError("y must be 2-D with contiguous rows (stride(1) == 1)")
    offs = [int(o) for o in slice_offsets]
    if len(offs) != num_slices + 1 or offs[0] < 0 or any(b <= a for a, b in zip(offs, offs[1:])):
        raise ValueError(f"slice_offsets must be {num_slices + 1} increasing boundaries, got {offs}")
    if offs[-1] > y.shape[1]:
        raise ValueError(f"slice_offsets end {offs[-1]} beyond y's {y.shape[1]} columns")
    return offs


def check_launch(x_or_s: torch.Tensor, pool: torch.Tensor, tables: LoraRowTables, meta: LoraBatchMeta,
                 layer: int, module_indices: Sequence[int]) -> None:
    """Checks shared by shrink and expand wrappers."""
    if not isinstance(meta, LoraBatchMeta):
        raise TypeError(f"the Triton path needs a LoraBatchMeta, got {type(meta).__name__}")
    if pool.dim() != 1 or not pool.is_contiguous():
        raise ValueError("pool must be a contiguous 1-D tensor")
    for name, t in (("pool", pool), ("tables", tables.ranks), ("meta", meta.token_indices)):
        if t.device != x_or_s.device:
            raise ValueError(f"{name} is on {t.device}, inputs on {x_or_s.device}")
    if not 0 <= layer < tables.num_layers:
        raise ValueError(f"layer {layer} out of range [0, {tables.num_layers})")
    if not 1 <= len(module_indices) <= MAX_SLICES:
        raise ValueError(f"1..{MAX_SLICES} slices per launch, got {len(module_indices)}")
    for m in module_indices:
        if not 0 <= m < tables.num_modules:
            raise ValueError(f"module index {m} out of range [0, {tables.num_modules})")


def lora_shrink_triton(
    x: torch.Tensor,                 # [T, H_in] fp16/bf16/fp32, rows contiguous
    pool: torch.Tensor,              # [num_pages * page_elems], same dtype as x
    tables: LoraRowTables,
    meta: LoraBatchMeta,             # prepared for these T tokens
    layer: int,
    module_indices: Sequence[int],   # dense module index per slice (1..4 slices)
    out: torch.Tensor,               # [num_slices, T, >= tables.max_rank] float32, contiguous
    config: dict[str, int] | None = None,  # overrides of shrink_config's choices (for tuning)
    out_zeroed: bool = False,        # `out` is all zeros already (no zeroing launch before a K split)
) -> None:
    """Shrink for every slice and adapter in one launch.

    Semantics:
        for t with slot a = a(t) >= 0, for i, m in enumerate(module_indices):
            r = tables.ranks[a, layer, m]
            out[i, t, :r] = (x[t].float() @ A[a, layer, m].float().T)
        other entries of `out` are unspecified (zeroed when the K split is used).
    A K split adds its partial sums into `out`, so it needs zeros there: the wrapper launches a zeroing
    first unless the caller says `out_zeroed` (the LoRA backend zeroes every layer's buffer in one launch
    per step).
    """
    check_launch(x, pool, tables, meta, layer, module_indices)
    T, K = x.shape
    num_slices = len(module_indices)
    check_input(x, pool)
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32, got {out.dtype}")
    if out.dim() != 3 or out.shape[0] != num_slices or out.shape[1] != T or out.shape[2] < tables.max_rank:
        raise ValueError(f"out must be [{num_slices}, {T}, >= {tables.max_rank}], got {tuple(out.shape)}")
    if T != meta.num_tokens:
        raise ValueError(f"meta was prepared for {meta.num_tokens} tokens, x has {T}")
    if T == 0 or (meta.has_lora is False and not _capturing(x.device)):
        return  # host-known empty batch; a graph being captured always gets the launch
    cfg = shrink_config(T, K, tables.max_rank, num_slices, meta.max_slots, x.device)
    if config:
        cfg.update(config)
        cfg["R_BLOCKS"] = 1 if cfg["WALK_R"] else cdiv(tables.max_rank, cfg["BLOCK_R"])
        cfg["K_PER_SPLIT"] = cdiv(cdiv(K, cfg["SPLIT_K"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
        cfg["SPLIT_K"] = cdiv(K, cfg["K_PER_SPLIT"])
    if cfg["SPLIT_K"] > 1 and not out_zeroed:
        out.zero_()
    pdl = bool(cfg.get("PDL", pdl_enabled(x.device)))
    mods = list(module_indices) + [0] * (MAX_SLICES - num_slices)
    tiles = cdiv(T, cfg["BLOCK_M"]) + min(meta.max_slots, T)
    grid = (num_slices * cfg["R_BLOCKS"] * cfg["SPLIT_K"], tiles)
    walk = bool(cfg["WALK_R"]) and cfg["BLOCK_R"] < tables.max_rank
    # The walk's loop would hold 40 more registers than one block (fewer programs an SM for every adapter);
    # bounded to the one-block kernel's count, the 16-bit code has no spills.
    bound = {"maxnreg": WALK_MAXNREG} if walk and pool.dtype != torch.float32 and x.is_cuda else {}
    _shrink_kernel[grid](
        x, x.stride(0), pool, tables.a_offsets, tables.ranks, out, out.stride(0), out.stride(1),
        meta.token_indices, meta.seg_starts, meta.seg_slots, meta.max_slots,
        layer, tables.num_layers, tables.num_modules, tables.max_rank, K, cfg["K_PER_SPLIT"],
        *mods,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_R=cfg["BLOCK_R"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=cfg["SPLIT_K"],
        MAX_SEGS=next_pow2(meta.max_slots), EVEN_K=(K % cfg["BLOCK_K"] == 0), R_BLOCKS=cfg["R_BLOCKS"],
        ROW_ALIGN=tables.row_alignment(), IEEE=pool.dtype == torch.float32,
        SMALL_R=min(SMALL_RANK, cfg["BLOCK_R"]), WALK_R=walk,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_args(pdl), **bound,
    )
