"""A decode step's token choice over the vocabulary in two launches, greedy and sampled rows together.

Launch 1, a program per (row, chunk of CHUNK tokens): each token's key is its logit (a greedy row, temperature 0)
or `logit / temperature - log(E)` with E = -log(u) ~ Exp(1) (a sampled row: the exponential race, argmax of p / E,
which draws from softmax(logit / temperature) without a softmax), u uniform from a counter-based generator
(`tl.rand`: Philox keyed by the row's draw seed, counted by the token's index), so a row's draw depends on its own
seed alone, never on its batch mates or on the launch's shape. The chunk stores its largest key and the first
index that holds it. Launch 2, a program per row: the first chunk holding the row's largest key gives the token.

Keys compare as floats do, NaN above everything (as `torch.argmax` ranks it) and -0 equal to +0 (both taken
as integers whose signed order is the floats' order), and ties go to the lowest index: a greedy row's token is
`torch.argmax`'s. Tokens the caller masked to -inf, or under the row's threshold key (top-k, top-p:
`kernels.sample_threshold`), are never drawn.
Against the library's per-row reductions (one block a row) and per-request generators (one launch a row):
`bench/sampler_cost.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096


@triton.jit
def _order_key(v):
    """int32 whose signed order is v's float order: -0 as +0, NaN (either sign) the largest."""
    v = tl.where(v == 0.0, 0.0, v)
    bits = v.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(v != v, 0x7FFFFFFF, key)


@triton.jit
def _race_value(v, t, seed, offs):
    """A sampled token's value in the exponential race: logit / t - log(E), E = -log(u), u uniform from the row's
    draw seed at the token's index (`offs`). Every race over a row (`kernels.sample_nucleus` too) draws this noise."""
    return v / t - tl.log(-tl.log(tl.rand(seed, offs)))


@triton.jit
def _chunks_winner(keys_ptr, idx_ptr, row, CHUNKS, BLOCK: tl.constexpr):
    """The row's token from its chunks' largest keys and their first indices: the first chunk holding the row's
    largest key gives it (int32)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < CHUNKS
    key = tl.load(keys_ptr + row * CHUNKS + offs, mask=mask, other=-2147483648)
    idx = tl.load(idx_ptr + row * CHUNKS + offs, mask=mask, other=2147483647)
    return tl.min(tl.where(key == tl.max(key, 0), idx, 2147483647), 0)


@triton.jit
def _chunk_kernel(logits_ptr, stride, V, temps_ptr, seeds_ptr, thr_ptr, top_p_ptr, stats_ptr, keys_ptr, idx_ptr,
                  CHUNKS, SAMPLED: tl.constexpr, FILTERED: tl.constexpr, NUCLEUS: tl.constexpr,
                  CHUNK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    v = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
    if FILTERED:                    # top-k / top-p: tokens under the row's threshold key are never drawn
        v = tl.where(_order_key(v) >= tl.load(thr_ptr + row), v, float("-inf"))
    if NUCLEUS:                     # a top-p row checked after the race: the chunk's max and mass under it
        if tl.load(top_p_ptr + row) < 1.0:
            top = tl.max(v, 0)
            a = 1.4426950408889634 / tl.load(temps_ptr + row)
            tl.store(stats_ptr + (row * CHUNKS + c) * 2, top)
            mass = tl.where(v > float("-inf"), tl.exp2((v - top) * a), 0.0)     # a chunk of -inf alone: 0
            tl.store(stats_ptr + (row * CHUNKS + c) * 2 + 1, tl.sum(mass, 0))
    if SAMPLED:
        t = tl.load(temps_ptr + row)
        if t > 0.0:
            v = _race_value(v, t, tl.load(seeds_ptr + row), offs)
    key = tl.where(mask, _order_key(v), -2147483648)
    best = tl.max(key, 0)
    first = tl.min(tl.where(key == best, offs, 2147483647), 0)
    tl.store(keys_ptr + row * CHUNKS + c, best)
    tl.store(idx_ptr + row * CHUNKS + c, first)


@triton.jit
def _row_kernel(keys_ptr, idx_ptr, out_ptr, CHUNKS, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tl.store(out_ptr + row, _chunks_winner(keys_ptr, idx_ptr, row, CHUNKS, BLOCK).to(tl.int64))


def choose_tokens(logits: torch.Tensor, temps: torch.Tensor | None = None, seeds: torch.Tensor | None = None,
                  thresholds: torch.Tensor | None = None, top_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] (rows contiguous) -> token ids [N] int64 on their device, not waited for. Without `temps`
    every row is greedy; else temps [N] float32 (0 = greedy) and seeds [N] int64, each sampled row's draw seed.
    `thresholds` [N] int32: each row draws only among tokens whose order key is at least its threshold
    (`kernels.sample_threshold.row_thresholds`, top-k / top-p). `top_p` [N] float32 (1 = off; sampled rows
    without a threshold): the race's winner is kept only inside the row's nucleus (`kernels.sample_nucleus`),
    the same token a threshold from `row_thresholds` gives."""
    n, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(vocab, CHUNK)
    keys = torch.empty(n, chunks, dtype=torch.int32, device=logits.device)
    idx = torch.empty(n, chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    sampled = temps is not None
    if sampled:
        assert seeds is not None and temps.shape == (n,) and seeds.shape == (n,)
    filtered, nucleus = thresholds is not None, top_p is not None
    assert not nucleus or (sampled and top_p.shape == (n,) and top_p.dtype == torch.float32)
    assert not filtered or (thresholds.shape == (n,) and thresholds.dtype == torch.int32)
    stats = torch.empty(n, chunks, 2, dtype=torch.float32, device=logits.device) if nucleus else keys
    _chunk_kernel[(n, chunks)](logits, logits.stride(0), vocab, temps if sampled else keys,
                               seeds if sampled else keys, thresholds if filtered else keys,
                               top_p if nucleus else keys, stats, keys, idx, chunks, SAMPLED=sampled,
                               FILTERED=filtered, NUCLEUS=nucleus, CHUNK=CHUNK, num_warps=4)
    block = max(16, triton.next_power_of_2(chunks))
    if nucleus:
        from kernels.sample_nucleus import PASS, RACE, nucleus_row_kernel

        nucleus_row_kernel[(n,)](keys, idx, out, chunks, logits, logits.stride(0), vocab, temps, seeds, top_p, stats,
                                 BLOCK=block, PASS=PASS, RACE=RACE, num_warps=16)
    else:
        _row_kernel[(n,)](keys, idx, out, chunks, BLOCK=block, num_warps=1)
    return out
