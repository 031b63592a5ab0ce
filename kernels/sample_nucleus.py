"""Top-p without a threshold: the race's winner checked against the row's nucleus, raced again above it if outside.

With the exponential race (`kernels.sample`) every token's noisy key is fixed by the row's draw seed, and the token
drawn from the nucleus N (the smallest set of largest-probability tokens whose mass under softmax(logits / T)
reaches p) is the best key inside N. If the best key over the whole row belongs to a token inside N it is that
token; if not, every token of N has a logit above the winner's, so the race run again over the tokens above the
winner (the same noise) loses nothing of N. Repeated until the winner is inside, this draws exactly the token a
threshold at N's boundary gives (`kernels.sample_threshold`), without finding the boundary: the first race is the
batch's launch over (row, chunk) programs, which also leaves each chunk's max and mass; this row program adds one
pass over the row (the mass above the winner: inside N when it is under p of the row's) and, for a winner outside
N (about a (1 - p) chance), one pass to race again and one to check, as often as needed (each raises the floor).

A token is inside N when the mass of the tokens strictly above it is under p (ties with it not counted: every
token tied with N's smallest is kept, as the threshold keeps them); the sums run in float32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.sample import _chunks_winner, _order_key, _race_value

PASS = 32768        # tokens a pass over a row reads at a time (16 warps: 128 KB in flight an SM)
RACE = 8192         # the same for a pass that races (its noise's registers: 32768 spilled 1.8 KB a thread)


@triton.jit
def _mass_over(row_ptr, V, floor, top, a, PASS: tl.constexpr):
    """sum(2^((v - top) a)) over the row's tokens v > floor."""
    total = tl.zeros([PASS], tl.float32)
    for start in range(0, V, PASS):
        offs = start + tl.arange(0, PASS)
        v = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        total += tl.where(v > floor, tl.exp2((v - top) * a), 0.0)
    return tl.sum(total, 0)


@triton.jit
def _race_over(row_ptr, V, floor, t, seed, RACE: tl.constexpr):
    """The race's winner (`kernels.sample._chunk_kernel`'s keys, the same noise) among the row's tokens whose
    key is above floor's, ties to the lowest index."""
    best = tl.full([], -2147483647 - 1, tl.int32)
    first = tl.full([], 0, tl.int32)
    above = _order_key(floor)
    for start in range(0, V, RACE):
        offs = start + tl.arange(0, RACE)
        mask = offs < V
        v = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        inside = mask & (_order_key(v) > above)
        key = tl.where(inside, _order_key(_race_value(v, t, seed, offs)), -2147483647 - 1)
        top = tl.max(key, 0)
        at = tl.min(tl.where(key == top, offs, 2147483647), 0)
        if top > best:
            best = top
            first = at
    return first


@triton.jit
def nucleus_row_kernel(keys_ptr, idx_ptr, out_ptr, CHUNKS, logits_ptr, stride, V, temps_ptr, seeds_ptr, top_p_ptr,
                       stats_ptr, BLOCK: tl.constexpr, PASS: tl.constexpr, RACE: tl.constexpr):
    """A program per row: the race's winner from the chunks' (as `kernels.sample._row_kernel`), then, for a row
    with top_p < 1, checked against its nucleus and raced again above it while outside."""
    row = tl.program_id(0)
    tok = _chunks_winner(keys_ptr, idx_ptr, row, CHUNKS, BLOCK)
    p = tl.load(top_p_ptr + row)
    if p < 1.0:
        t = tl.load(temps_ptr + row)
        a = 1.4426950408889634 / t
        offs = tl.arange(0, BLOCK)
        mask = offs < CHUNKS
        m = tl.load(stats_ptr + (row * CHUNKS + offs) * 2, mask=mask, other=float("-inf"))
        s = tl.load(stats_ptr + (row * CHUNKS + offs) * 2 + 1, mask=mask, other=0.0)
        top = tl.max(m, 0)
        limit = p * tl.sum(tl.where(s > 0.0, s * tl.exp2((m - top) * a), 0.0), 0)
        row_ptr = logits_ptr + row.to(tl.int64) * stride
        seed = tl.load(seeds_ptr + row)
        floor = tl.load(row_ptr + tok).to(tl.float32)
        # while the winner is outside the nucleus (a row of -inf alone has no mass: its token is the first)
        while (_mass_over(row_ptr, V, floor, top, a, PASS) >= limit) & (limit > 0.0):
            tok = _race_over(row_ptr, V, floor, t, seed, RACE)
            floor = tl.load(row_ptr + tok).to(tl.float32)
    tl.store(out_ptr + row, tok.to(tl.int64))
