"""Top-k / top-p as a per-row threshold on the logits, without sorting the vocabulary.

A row's kept tokens (top-k: its k largest logits; top-p: the smallest set of largest-probability tokens whose mass
under softmax(logits / temperature), renormalized over the top-k where both are set, reaches p) are the tokens
whose logit is at least a threshold, so a row needs one number: the order key (`kernels.sample._order_key`) of its
smallest kept logit. `kernels.sample.choose_tokens` masks every token below it as it draws.

Where it comes from, one program a row: the row's `cands` largest logits (`torch.topk`, sorted) give the top-k
threshold (the k-th of them) and, with the row's normalizer (one pass over the row, the tokens under the top-k
threshold left out), the top-p one: the candidate where the cumulative mass before it reaches p. A row whose
kept set is wider than the candidates (top-k above `cands`, or a nucleus whose mass the candidates do not reach)
finds its threshold exactly in the same program, by bisection over the order keys (each step a pass over the row,
up to 32), so no row is cut short and nothing waits for the host.

Ties at a threshold are all kept (a sort of the row, as the sampler did until 5ab306d, keeps an arbitrary subset
of them); a row's mass sums run in float32 in the program's order, so a token whose cumulative mass lies within
rounding of p may fall on either side.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sample import _order_key

NONE = -2147483648          # the threshold of a row that keeps every token (no real logit has this key)
BLOCK = 32768               # tokens a pass over a row reads at a time (16 warps: 128 KB in flight an SM)
_MIN = tl.constexpr(NONE)   # int32 literals (a bare -2147483648 would be a 64-bit one)
_MAX = tl.constexpr(2147483647)


@triton.jit
def _value_of(key):
    """The float whose order key is `key` (the key's map is its own inverse; -1 gives -0.0, which compares as 0)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _mass_from(row_ptr, V, lowest, a, b, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """Over the row's tokens v >= lowest: their count (COUNT) or their unnormalized mass sum(2^(v a - b))."""
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        inside = (offs < V) & (v >= lowest)
        if COUNT:
            total += tl.where(inside, 1.0, 0.0)
        else:
            total += tl.where(inside, tl.exp2(v * a - b), 0.0)
    return tl.sum(total, 0)


@triton.jit
def _bisect(row_ptr, V, hi, floor, target, a, b, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """The smallest key k <= hi (the caller knows hi qualifies) such that the tokens >= floor whose key is above
    k weigh less than target: the key of the row's smallest kept token. Each step a pass over the row."""
    lo = hi.to(tl.int64) * 0 - 2139095041                              # the order key of -inf
    hi = hi.to(tl.int64)
    while lo < hi:
        mid = lo + (hi - lo) // 2
        above = tl.maximum(_value_of((mid + 1).to(tl.int32)), floor)     # key > mid is v >= the next key's value
        if _mass_from(row_ptr, V, above, a, b, COUNT, BLOCK) < target:
            hi = mid
        else:
            lo = mid + 1
    return hi.to(tl.int32)


@triton.jit
def _threshold_kernel(logits_ptr, stride, V, rows_ptr, cand_ptr, K, temps_ptr, top_k_ptr, top_p_ptr, thr_ptr,
                      CAND: tl.constexpr, BLOCK: tl.constexpr):
    f = tl.program_id(0)
    row = tl.load(rows_ptr + f)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    t = tl.load(temps_ptr + f)
    kk = tl.load(top_k_ptr + f)
    p = tl.load(top_p_ptr + f)
    j = tl.arange(0, CAND)
    c = tl.load(cand_ptr + f.to(tl.int64) * K + j, mask=j < K, other=float("-inf")).to(tl.float32)
    ckey = tl.where(j < K, _order_key(c), _MIN)
    last = tl.max(tl.where(j == K - 1, ckey, _MIN), 0)             # the smallest candidate's key
    floor_key = last * 0 + _MIN
    if (kk > 0) & (kk < V):
        if kk <= K:
            floor_key = tl.max(tl.where(j == kk - 1, ckey, _MIN), 0)
        else:                                                         # wider than the candidates: count
            floor_key = _bisect(row_ptr, V, last, float("-inf"), kk.to(tl.float32), 0.0, 0.0, True, BLOCK)
    thr = floor_key
    if p < 1.0:
        floor = tl.where(floor_key == _MIN, float("-inf"), _value_of(floor_key))
        a = 1.4426950408889634 / t                                   # 2^(v a - b) = e^((v - max) / t)
        b = tl.max(c, 0) * a
        mass = _mass_from(row_ptr, V, floor, a, b, False, BLOCK)
        w = tl.where(c >= floor, tl.exp2(c * a - b), 0.0) / mass
        before = tl.cumsum(w, 0) - w
        kept = (before < p) & (c >= floor) & (j < K)
        n = tl.sum(kept.to(tl.int32), 0)
        if (n < K) | (K >= V):                                        # the nucleus ends inside the candidates
            tau = tl.min(tl.where(kept, ckey, _MAX), 0)
        else:
            tau = _bisect(row_ptr, V, last, floor, p * mass, a, b, False, BLOCK)
        # the row's largest token always stays (its mass is NaN where a logit is +inf: nothing else is "kept")
        thr = tl.maximum(thr, tl.minimum(tau, tl.max(ckey, 0)))
    tl.store(thr_ptr + row, thr)


def candidates_for(top_ks: list[int], any_top_p: bool, vocab: int) -> int:
    """How many of each row's largest logits to take as candidates: 1024 with top-p (a nucleus of a trained
    model's row at the temperatures people use is far narrower; a wider one is found exactly, slower), else the
    top-k rounded up to 64 or 1024; never more than the vocabulary."""
    if any_top_p or max(top_ks, default=0) > 64:
        return min(vocab, 1024)
    return min(vocab, 64)


def row_thresholds(logits: torch.Tensor, rows: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, cands: int) -> torch.Tensor:
    """logits [N, V] (rows contiguous); for the F rows `rows` [F] int64 (ascending), their temps [F] float32 (> 0),
    top_k [F] int32 (0 = off) and top_p [F] float32 (1 = off) -> thresholds [N] int32 on the logits' device (NONE
    for rows not listed), not waited for. `cands`: candidates a row (`candidates_for`).

    Semantics, row i = rows[f] (ties at the threshold all kept):
        s = logits[i] / temps[f]; keep = s >= s.topk(top_k[f]).values[-1] if 0 < top_k[f] < V else all tokens
        p = softmax(s[keep]) by value, largest first; kept = the smallest such prefix with mass >= top_p[f]
        thresholds[i] = order_key(min(logits[i][kept]))        # NONE where every token stays
    """
    n, vocab = logits.shape
    f = rows.numel()
    if rows.dtype != torch.int64 or temps.dtype != torch.float32 or top_k.dtype != torch.int32 \
            or top_p.dtype != torch.float32:
        raise TypeError("rows int64, temps float32, top_k int32, top_p float32")
    if temps.shape != (f,) or top_k.shape != (f,) or top_p.shape != (f,) or f > n:
        raise ValueError(f"rows, temps, top_k and top_p are [F] with F <= {n}: {rows.shape}, {temps.shape}, "
                         f"{top_k.shape}, {top_p.shape}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    every = f == n
    thr = (torch.empty(n, dtype=torch.int32, device=logits.device) if every
           else torch.full((n,), NONE, dtype=torch.int32, device=logits.device))
    if f == 0:
        return thr
    cands = min(cands, vocab)
    picked = logits if every else logits.index_select(0, rows)
    top = picked.topk(cands, dim=-1).values.contiguous()
    _threshold_kernel[(f,)](logits, logits.stride(0), vocab, rows, top, cands, temps, top_k, top_p, thr,
                            CAND=triton.next_power_of_2(cands), BLOCK=BLOCK, num_warps=16)
    return thr
