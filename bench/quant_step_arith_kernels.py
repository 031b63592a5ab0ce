"""The kernels of bench/quant_step_arith.py: bench/quant_layer_probe.py's chain (`launches_early`) and persistent
(`preload_split`) structures over the 8B's four projections, with the one-row kernel's arithmetic on each unit of
words (ARITH) or the words alone summed as floats (as the layer probe does).

A unit is [BN rows, 32 words] of a row-major [N, W] weight (the engine's packed layout: unit u is rows
(u // (W / 32)) BN.., block u mod (W / 32)); a program takes every P-th unit of a phase, one unit ahead (the next
unit's words requested before the current one's arithmetic), its first PRE (0-2) units read before its wait. With
ARITH a unit's words go through `kernels.quant_gemv.h2_block` (bfloat16 x in float16 pairs, the group scales and
offsets of groups of 128 read in the words' layout from s_ptr / o_ptr, which hold a weight's [W / 16, N] scales
followed by its offsets, at an eighth of the weight's word offset) and its [BN] sums are added to out atomically,
as a persistent kernel's every-P-th units would have to leave them. Under TRITON_INTERPRET=1 the barriers are
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
def _unit(w_ptr, i, pid, P, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr):
    """Unit i of this program in a [N, W] weight: its words [BN, 32] (zeros past the weight's units), rows, block
    and which rows exist ([BN]: all false past the weight's units)."""
    CHUNKS: tl.constexpr = W // 32
    UNITS: tl.constexpr = (N // BN) * CHUNKS
    u = pid + i * P
    tile = u // CHUNKS
    block = u - tile * CHUNKS
    rows = tile * BN + tl.arange(0, BN)
    cols = tl.arange(0, 32)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * W + block * 32 + cols[None, :]
    valid = (rows < N) & ((u + rows * 0) < UNITS)        # vectors: the interpreter takes no scalar in a mask
    return tl.load(ptrs, mask=valid[:, None] & (cols < 32)[None, :], other=0), rows, block, valid


@triton.jit
def _use(words, rows, block, valid, acc, x_ptr, s_ptr, out_ptr, N: tl.constexpr, W: tl.constexpr,
         ARITH: tl.constexpr, ASM: tl.constexpr):
    """One unit's work: ARITH, its products' sums added to out[rows]; else its words summed into acc as floats."""
    if ARITH:
        o_ptr = s_ptr + (N * W) // 16
        s, o = scale_tiles(s_ptr, o_ptr, 2 * block, 2 * block + 1, tl.minimum(rows, N - 1), N, ASM)
        xv = x_words(x_ptr, block, tl.arange(0, 32), 8 * W, True)
        part = h2_block(words, xv, s, o, tl.zeros(words.shape, tl.float32), ASM)
        tl.atomic_add(out_ptr + rows, tl.sum(part, 1), mask=valid, sem="relaxed")
    else:
        acc += words.to(tl.float32, bitcast=True)
    return acc


@triton.jit
def _phase(w_ptr, x_ptr, s_ptr, out_ptr, acc, p0, p1, pid, P, N: tl.constexpr, W: tl.constexpr,
           BN: tl.constexpr, PRE: tl.constexpr, ARITH: tl.constexpr, ASM: tl.constexpr):
    """Every unit of this program in the phase, the first PRE of them already read (p0, p1), the rest each
    requested one unit ahead of its use."""
    UNITS: tl.constexpr = (N // BN) * (W // 32)
    mine = (UNITS - pid + P - 1) // P
    if PRE > 0:
        w0, r0, b0, v0 = p0
        acc = _use(w0, r0, b0, v0, acc, x_ptr, s_ptr, out_ptr, N, W, ARITH, ASM)
    if PRE > 1:
        w1, r1, b1, v1 = p1
        acc = _use(w1, r1, b1, v1, acc, x_ptr, s_ptr, out_ptr, N, W, ARITH, ASM)
    cur_w, cur_r, cur_b, cur_v = _unit(w_ptr, PRE, pid, P, N, W, BN)
    for i in range(PRE, mine):
        nxt_w, nxt_r, nxt_b, nxt_v = _unit(w_ptr, i + 1, pid, P, N, W, BN)
        acc = _use(cur_w, cur_r, cur_b, cur_v, acc, x_ptr, s_ptr, out_ptr, N, W, ARITH, ASM)
        cur_w, cur_r, cur_b, cur_v = nxt_w, nxt_r, nxt_b, nxt_v
    return acc


@triton.jit
def _blank(BN: tl.constexpr):
    """A unit that was not read (what `_first` returns for units PRE does not ask for)."""
    rows = tl.arange(0, BN)
    return tl.zeros((BN, 32), tl.int32), rows, 0, rows < 0


@triton.jit
def _first(w_ptr, pid, P, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, PRE: tl.constexpr):
    """This program's first two units of a weight, read where PRE asks for them."""
    if PRE > 0:
        p0 = _unit(w_ptr, 0, pid, P, N, W, BN)
    else:
        p0 = _blank(BN)
    if PRE > 1:
        p1 = _unit(w_ptr, 1, pid, P, N, W, BN)
    else:
        p1 = _blank(BN)
    return p0, p1


@triton.jit
def one_phase(w_ptr, x_ptr, s_ptr, out_ptr, acc_ptr, P, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr,
              PRE: tl.constexpr, ARITH: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """One projection as a launch of its own (the chain): its first PRE units read before the wait."""
    pid = tl.program_id(0)
    p0, p1 = _first(w_ptr, pid, P, N, W, BN, PRE)
    wait_then_release(USE_PDL)
    acc = _phase(w_ptr, x_ptr, s_ptr, out_ptr, tl.zeros((BN, 32), tl.float32), p0, p1, pid, P, N, W, BN, PRE,
                 ARITH, ASM)
    if not ARITH:
        tl.atomic_add(acc_ptr + pid * BN + tl.arange(0, BN), tl.sum(acc, 1))


@triton.jit
def _sync(bar_ptr, target, w_next, pid, P, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, PRE: tl.constexpr,
          ON: tl.constexpr, NT: tl.constexpr):
    """A grid barrier; this program's first PRE units of the next weight requested between arriving and waiting."""
    _arrive(bar_ptr, ON)
    p0, p1 = _first(w_next, pid, P, N, W, BN, PRE)
    _wait(bar_ptr, target, ON, 0, NT)
    return p0, p1


@triton.jit
def layers(w_ptr, x_ptr, s_ptr, out_ptr, acc_ptr, bar_ptr, P, L,
           N0: tl.constexpr, W0: tl.constexpr, N1: tl.constexpr, W1: tl.constexpr,
           N2: tl.constexpr, W2: tl.constexpr, N3: tl.constexpr, W3: tl.constexpr,
           O1: tl.constexpr, O2: tl.constexpr, O3: tl.constexpr, LW: tl.constexpr,
           BN: tl.constexpr, PRE: tl.constexpr, ARITH: tl.constexpr, ASM: tl.constexpr, BARRIER: tl.constexpr,
           NT: tl.constexpr):
    """The step's projections in one launch, a grid barrier between phases, each program requesting its first
    units of the next projection between arriving and waiting (bench/quant_layer_probe.py's `preload_split`)."""
    pid = tl.program_id(0)
    acc = tl.zeros((BN, 32), tl.float32)
    p0, p1 = _first(w_ptr, pid, P, N0, W0, BN, PRE)
    for layer in range(L):
        wl = w_ptr + layer * LW
        sl = s_ptr + layer * (LW // 8)
        acc = _phase(wl, x_ptr, sl, out_ptr, acc, p0, p1, pid, P, N0, W0, BN, PRE, ARITH, ASM)
        p0, p1 = _sync(bar_ptr, (4 * layer + 1) * P, wl + O1, pid, P, N1, W1, BN, PRE, BARRIER, NT)
        acc = _phase(wl + O1, x_ptr, sl + O1 // 8, out_ptr, acc, p0, p1, pid, P, N1, W1, BN, PRE, ARITH, ASM)
        p0, p1 = _sync(bar_ptr, (4 * layer + 2) * P, wl + O2, pid, P, N2, W2, BN, PRE, BARRIER, NT)
        acc = _phase(wl + O2, x_ptr, sl + O2 // 8, out_ptr, acc, p0, p1, pid, P, N2, W2, BN, PRE, ARITH, ASM)
        p0, p1 = _sync(bar_ptr, (4 * layer + 3) * P, wl + O3, pid, P, N3, W3, BN, PRE, BARRIER, NT)
        acc = _phase(wl + O3, x_ptr, sl + O3 // 8, out_ptr, acc, p0, p1, pid, P, N3, W3, BN, PRE, ARITH, ASM)
        p0, p1 = _sync(bar_ptr, (4 * layer + 4) * P, wl + LW, pid, P, N0, W0, BN, PRE, BARRIER, NT)
    if not ARITH:
        tl.store(acc_ptr + pid * BN + tl.arange(0, BN), tl.sum(acc, 1))
