"""A one-token LoRA's expand in the one-row base kernel's epilogue (`LORAPLEX_LORA_TAIL=1`, for A/B runs; off).

A one-token step with an adapter runs its LoRA first (compute_service/engine/model.py, `_project`). By default
that is one fused launch (kernels/fused.py: shrink programs, then expand programs that wait for them) writing a
float32 delta the base kernel adds at its end. With the tail, the launch before the base kernel is a shrink only
(`lora_shrink` into the backend's per-layer sums, a few dozen programs that wait for nothing), and each program of
the base kernel adds `s @ B^T` for its own output features itself: before its wait for the shrink launch (after
its own weights) it finds each feature's slice, table entry and rank; after the wait it reads, TAIL_ROWS rank rows
at a time, their offsets and the token's sums (rounded to the pool's dtype, as the fused kernel rounds them), then
the rows' B^T values at its features: two round trips for an adapter of rank <= 16, against one for the addend.
No expand programs share the SMs with the base kernel's, none of them wait on an SM, and no delta is written
and read back. Under split-K the first split's programs add it.

`TailArgs` carries what the kernels read: the shrink's sums `[slices, >= max_rank]` float32 for the token (slice
stride `sums.stride(0)`), the pool and its row tables, the step's segment slots (one token: segment 0's slot, -1
without an adapter), the layer, up to three slices' modules and their first output features. A feature's slice is
found per feature, so a program's features may straddle slices (the default model's q/k/v widths are not
multiples of 128).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.pdl import wait_then_release

MAX_TAIL_SLICES = 3
# Rank rows a base program adds at a time: its loads of those rows' offsets, then of their B^T values, are
# issued together (sm_90 code: the offsets' loads first, then the values' and the sums' streamed). 16 keeps the
# one-row 4-bit kernel at its 167-168 registers on sm_90 (three programs an SM); so would 64 (one chunk for any
# rank up to 64), but a rank-16 adapter then issues ~1150 instructions a warp, most of them masked off, against
# ~300; rank 64 pays four chunks of two round trips with 16. The whole [16, 128] tile of B^T read before the
# wait as one block took the kernel to 254 registers (two programs an SM).
TAIL_ROWS = 16


@dataclass(frozen=True)
class TailArgs:
    sums: torch.Tensor          # [slices, >= max_rank] float32: the token's shrink sums of each slice
    pool: torch.Tensor          # the adapter pool (16-bit or float32)
    b_offsets: torch.Tensor     # LoraRowTables.b_offsets
    ranks: torch.Tensor         # LoraRowTables.ranks
    seg_slots: torch.Tensor     # LoraBatchMeta.seg_slots (segment 0: the token's slot, -1 without an adapter)
    layer: int
    num_layers: int
    num_modules: int
    max_rank: int
    modules: tuple[int, ...]    # the dense module index of each slice (1-3)
    starts: tuple[int, ...]     # the first output feature of each slice (starts[0] == 0), increasing

    def __post_init__(self) -> None:
        n = len(self.modules)
        if not 1 <= n <= MAX_TAIL_SLICES or len(self.starts) != n or self.starts[0] != 0:
            raise ValueError(f"1-{MAX_TAIL_SLICES} slices with their first features (the first 0), got modules "
                             f"{self.modules} starts {self.starts}")
        if self.sums.dtype != torch.float32 or self.sums.dim() != 2 or self.sums.shape[0] < n \
                or self.sums.shape[1] < self.max_rank or self.sums.stride(1) != 1:
            raise ValueError(f"sums must be float32 [>= {n}, >= {self.max_rank}] with unit stride, got "
                             f"{self.sums.dtype} {tuple(self.sums.shape)}")

    def kernel_kwargs(self, n: int) -> dict[str, Any]:
        """The kernels' tail arguments for an output of n features (slices past the last start at n)."""
        starts = list(self.starts[1:]) + [n] * (MAX_TAIL_SLICES - len(self.starts))
        mods = list(self.modules) + [0] * (MAX_TAIL_SLICES - len(self.modules))
        return dict(tail_sums_ptr=self.sums, tail_stride=self.sums.stride(0), tail_pool_ptr=self.pool,
                    tail_boff_ptr=self.b_offsets, tail_ranks_ptr=self.ranks, tail_slots_ptr=self.seg_slots,
                    tail_layer=self.layer, tail_layers=self.num_layers, tail_modules=self.num_modules,
                    tail_max_rank=self.max_rank, tail_mod0=mods[0], tail_mod1=mods[1], tail_mod2=mods[2],
                    tail_off1=starts[0], tail_off2=starts[1], TAIL=True, TAIL_R=TAIL_ROWS)


@triton.jit
def tail_tile(offs_n, live, slots_ptr, ranks_ptr, layer, num_layers, num_modules, mod0, mod1, mod2, off1, off2):
    """Before the wait (the step's slot and the tables only): per feature its slice, column in the slice, table
    entry and rank (0 where not `live` or the token has no adapter)."""
    slot = tl.load(slots_ptr).to(tl.int64)
    sl = (offs_n >= off1).to(tl.int32) + (offs_n >= off2).to(tl.int32)
    module = tl.where(sl == 0, mod0, tl.where(sl == 1, mod1, mod2))
    col = offs_n - tl.where(sl == 0, 0, tl.where(sl == 1, off1, off2))
    on = (live.to(tl.int32) * (slot >= 0).to(tl.int32)) != 0
    entry = tl.where(on, (slot * num_layers + layer) * num_modules + module, 0)
    rank = tl.load(ranks_ptr + entry, mask=on, other=0)
    return sl, col, entry, rank


@triton.jit
def tail_add(total, sl, col, entry, rank, sums_ptr, stride, boff_ptr, pool_ptr, max_rank, R: tl.constexpr):
    """After the wait: total + s @ B^T for each feature (s: its slice's sums, rounded to the pool's dtype), R
    rank rows at a time."""
    dt = pool_ptr.dtype.element_ty
    row0 = boff_ptr + entry * max_rank
    s0 = sums_ptr + sl * stride
    for r0 in range(0, tl.max(rank, axis=0), R):
        for j in tl.static_range(R):
            m = r0 + j < rank
            row = tl.load(row0 + r0 + j, mask=m, other=0)
            b = tl.load(pool_ptr + row + col, mask=m, other=0.0)
            s = tl.load(s0 + r0 + j, mask=m, other=0.0, cache_modifier=".cg")
            total += s.to(dt).to(tl.float32) * b.to(tl.float32)
    return total


@triton.jit
def late_wait(total, offs_n, live, USE_PDL: tl.constexpr, ADD: tl.constexpr, tail_sums_ptr, tail_stride,
              tail_pool_ptr, tail_boff_ptr, tail_ranks_ptr, tail_slots_ptr, tail_layer, tail_layers, tail_modules,
              tail_max_rank, tail_mod0, tail_mod1, tail_mod2, tail_off1, tail_off2, TAIL: tl.constexpr,
              TAIL_R: tl.constexpr):
    """The wait of a one-row program that read x early (ADD: the addend follows in `one_row_out`; TAIL: total plus
    the one-token LoRA's s @ B^T of its `live` features, kernels/lora_tail.py)."""
    if TAIL:
        sl, col, entry, rank = tail_tile(offs_n, live, tail_slots_ptr, tail_ranks_ptr, tail_layer, tail_layers,
                                         tail_modules, tail_mod0, tail_mod1, tail_mod2, tail_off1, tail_off2)
        wait_then_release(USE_PDL)
        total = tail_add(total, sl, col, entry, rank, tail_sums_ptr, tail_stride, tail_boff_ptr, tail_pool_ptr,
                         tail_max_rank, TAIL_R)
    if ADD:
        wait_then_release(USE_PDL)
    return total


def tail_kwargs(tail: TailArgs | None, n: int, like: torch.Tensor) -> dict[str, Any]:
    """The kernels' tail arguments, or placeholders (`like`: any tensor on the device) without a tail."""
    if tail is not None:
        return tail.kernel_kwargs(n)
    return dict(tail_sums_ptr=like, tail_stride=0, tail_pool_ptr=like, tail_boff_ptr=like, tail_ranks_ptr=like,
                tail_slots_ptr=like, tail_layer=0, tail_layers=1, tail_modules=1, tail_max_rank=1, tail_mod0=0,
                tail_mod1=0, tail_mod2=0, tail_off1=0, tail_off2=0, TAIL=False, TAIL_R=TAIL_ROWS)


__all__ = ["TAIL_ROWS", "TailArgs", "late_wait", "tail_add", "tail_kwargs", "tail_tile"]
