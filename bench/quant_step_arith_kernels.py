"""The kernels of bench/quant_step_arith.py: bench/quant_layer_probe.py's chain (`launches_early`) and persistent
(`preload_split`) structures over the 8B's four projections, with the one-row kernel's arithmetic on each unit of
words (ARITH) or the words alone summed as floats (as the layer probe does).

A unit is [BN rows, 32 words] of a row-major [N, W] weight (the engine's packed layout). A program takes a
contiguous range of a phase's units in tile-major order (a tile's blocks in turn, as the engine's split-K
programs do), each unit's words requested one unit ahead of its use, its first unit before its wait where PRE,
and adds a tile's [BN] sums to out atomically once its range leaves the tile. With ARITH a unit's words go
through `kernels.quant_gemv.h2_block` (bfloat16 x in float16 pairs, the group scales and offsets of groups of
128 read in the words' layout from s_ptr, which holds a weight's [W / 16, N] scales followed by its offsets at an
eighth of the weight's word offset); else they are summed as floats. Under TRITON_INTERPRET=1 the barriers are
compiled out (programs run one after another) and the assembly falls back to its Triton form.
"""
from __future__ import annotations

import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels.pdl import wait_then_release  # noqa: E402
from kernels.quant_gemv import h2_block, scale_tiles, x_words  # noqa: E402
from quant_layer_probe_kernels import _arrive, _wait  # noqa: E402


@triton.jit
def _range(pid, P, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr):
    """This program's units of a [N, W] weight: a contiguous range of the tile-major order (unit u: rows
    (u // (W / 32)) BN.., block u mod (W / 32)), as split-K programs take a tile's blocks."""
    UNITS: tl.constexpr = (N // BN) * (W // 32)
    return pid * UNITS // P, (pid + 1) * UNITS // P


@triton.jit
def _unit(w_ptr, u, hi, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr):
    """Unit u's words [BN, 32] (zeros where u >= hi), its rows and block."""
    CHUNKS: tl.constexpr = W // 32
    tile = u // CHUNKS
    block = u - tile * CHUNKS
    rows = tile * BN + tl.arange(0, BN)
    cols = tl.arange(0, 32)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * W + block * 32 + cols[None, :]
    ok = (u + cols * 0) < hi                         # a vector: the interpreter takes no scalar in a mask
    return tl.load(ptrs, mask=(rows < N)[:, None] & ok[None, :], other=0), rows, block


@triton.jit
def _use(words, block, acc, x_ptr, s_ptr, rows, N: tl.constexpr, W: tl.constexpr, ARITH: tl.constexpr,
         ASM: tl.constexpr):
    """acc plus one unit: ARITH, its products (`h2_block`); else its words as floats."""
    if ARITH:
        s, o = scale_tiles(s_ptr, s_ptr + (N * W) // 16, 2 * block, 2 * block + 1, tl.minimum(rows, N - 1), N, ASM)
        acc = h2_block(words, x_words(x_ptr, block, tl.arange(0, 32), 8 * W, True), s, o, acc, ASM)
    else:
        acc += words.to(tl.float32, bitcast=True)
    return acc


@triton.jit
def _phase(w_ptr, x_ptr, s_ptr, out_ptr, pre, pid, P, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr,
           PRE: tl.constexpr, ARITH: tl.constexpr, ASM: tl.constexpr):
    """Every unit of this program's range, each requested one unit ahead of its use (the first in `pre` where
    PRE), a tile's sums added to out[rows] once the range leaves it (or ends)."""
    CHUNKS: tl.constexpr = W // 32
    lo, hi = _range(pid, P, N, W, BN)
    if PRE:
        cur_w, cur_r, cur_b = pre
    else:
        cur_w, cur_r, cur_b = _unit(w_ptr, lo, hi, N, W, BN)
    acc = tl.zeros((BN, 32), tl.float32)
    for u in range(lo, hi):
        nxt_w, nxt_r, nxt_b = _unit(w_ptr, u + 1, hi, N, W, BN)
        acc = _use(cur_w, cur_b, acc, x_ptr, s_ptr, cur_r, N, W, ARITH, ASM)
        if ((u + 1) % CHUNKS == 0) | (u + 1 == hi):
            tl.atomic_add(out_ptr + cur_r, tl.sum(acc, 1), mask=cur_r < N, sem="relaxed")
            acc = tl.zeros((BN, 32), tl.float32)
        cur_w, cur_r, cur_b = nxt_w, nxt_r, nxt_b


@triton.jit
def _first(w_ptr, pid, P, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, PRE: tl.constexpr):
    """This program's first unit of a weight where PRE asks for it (else an empty one, not read)."""
    lo, hi = _range(pid, P, N, W, BN)
    if PRE:
        unit = _unit(w_ptr, lo, hi, N, W, BN)
    else:
        unit = _unit(w_ptr, lo, lo, N, W, BN)          # every load masked off
    return unit


@triton.jit
def one_phase(w_ptr, x_ptr, s_ptr, out_ptr, P, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr,
              PRE: tl.constexpr, ARITH: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """One projection as a launch of its own (the chain): its first unit read before the wait where PRE."""
    pid = tl.program_id(0)
    pre = _first(w_ptr, pid, P, N, W, BN, PRE)
    wait_then_release(USE_PDL)
    _phase(w_ptr, x_ptr, s_ptr, out_ptr, pre, pid, P, N, W, BN, PRE, ARITH, ASM)


@triton.jit
def _sync(bar_ptr, target, w_next, pid, P, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, PRE: tl.constexpr,
          ON: tl.constexpr, NT: tl.constexpr):
    """A grid barrier; this program's first unit of the next weight requested between arriving and waiting."""
    _arrive(bar_ptr, ON)
    pre = _first(w_next, pid, P, N, W, BN, PRE)
    _wait(bar_ptr, target, ON, 0, NT)
    return pre


@triton.jit
def layers(w_ptr, x_ptr, s_ptr, out_ptr, bar_ptr, P, L,
           N0: tl.constexpr, W0: tl.constexpr, N1: tl.constexpr, W1: tl.constexpr,
           N2: tl.constexpr, W2: tl.constexpr, N3: tl.constexpr, W3: tl.constexpr,
           O1: tl.constexpr, O2: tl.constexpr, O3: tl.constexpr, LW: tl.constexpr,
           BN: tl.constexpr, PRE: tl.constexpr, ARITH: tl.constexpr, ASM: tl.constexpr, BARRIER: tl.constexpr,
           NT: tl.constexpr):
    """The step's projections in one launch, a grid barrier between phases, each program requesting its first
    unit of the next projection between arriving and waiting (bench/quant_layer_probe.py's `preload_split`)."""
    pid = tl.program_id(0)
    pre = _first(w_ptr, pid, P, N0, W0, BN, PRE)
    for layer in range(L):
        wl = w_ptr + layer * LW
        sl = s_ptr + layer * (LW // 8)
        _phase(wl, x_ptr, sl, out_ptr, pre, pid, P, N0, W0, BN, PRE, ARITH, ASM)
        pre = _sync(bar_ptr, (4 * layer + 1) * P, wl + O1, pid, P, N1, W1, BN, PRE, BARRIER, NT)
        _phase(wl + O1, x_ptr, sl + O1 // 8, out_ptr, pre, pid, P, N1, W1, BN, PRE, ARITH, ASM)
        pre = _sync(bar_ptr, (4 * layer + 2) * P, wl + O2, pid, P, N2, W2, BN, PRE, BARRIER, NT)
        _phase(wl + O2, x_ptr, sl + O2 // 8, out_ptr, pre, pid, P, N2, W2, BN, PRE, ARITH, ASM)
        pre = _sync(bar_ptr, (4 * layer + 3) * P, wl + O3, pid, P, N3, W3, BN, PRE, BARRIER, NT)
        _phase(wl + O3, x_ptr, sl + O3 // 8, out_ptr, pre, pid, P, N3, W3, BN, PRE, ARITH, ASM)
        pre = _sync(bar_ptr, (4 * layer + 4) * P, wl + LW, pid, P, N0, W0, BN, PRE, BARRIER, NT)
