"""The kernels of bench/quant_layer_probe.py (what each mode launches; the modes are described there).

Loads and no arithmetic: a 4-bit 8B step's packed words summed as floats, per [block_n, 32-word] unit, with
grid barriers (atomic counters) between a layer's phases, or as one launch a phase. Compiled only on a GPU
with barriers; under TRITON_INTERPRET=1 (programs run one after another) the barriers are compiled out.
"""
from __future__ import annotations

import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels.pdl import wait_then_release  # noqa: E402

NORM_WORDS, ATTN_PROGRAMS, ATTN_WORDS = 2048, 8, 65536


@triton.jit
def _group(w_ptr, i0, pid, P, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    """Units i0 .. i0 + D - 1 of this program in a [N, W] weight (its unit i: pid + i * P), as floats."""
    CHUNKS: tl.constexpr = W // 32
    UNITS: tl.constexpr = (N // BN) * CHUNKS
    u = pid + (i0 + tl.arange(0, D)) * P
    tile = u // CHUNKS
    chunk = u - tile * CHUNKS
    rows = tile[:, None] * BN + tl.arange(0, BN)[None, :]
    ptrs = w_ptr + rows.to(tl.int64)[:, :, None] * W + (chunk * 32)[:, None, None] + tl.arange(0, 32)[None, None, :]
    return tl.load(ptrs, mask=(u < UNITS)[:, None, None], other=0).to(tl.float32, bitcast=True)


@triton.jit
def _phase(w_ptr, acc, pre, pid, P, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
           PRE: tl.constexpr, READ: tl.constexpr = 1):
    """acc plus every unit of this program in the phase; `pre` holds its first PRE units (PRE 0: none)."""
    UNITS: tl.constexpr = (N // BN) * (W // 32)
    mine = (UNITS - pid + P - 1) // P * READ
    if PRE > 0:
        acc += tl.sum(pre, 0)
    for i0 in range(PRE, mine, D):
        acc += tl.sum(_group(w_ptr, i0, pid, P, N, W, BN, D), 0)
    return acc


@triton.jit
def _small(kv_ptr, tot, pid, PROGRAMS: tl.constexpr, WORDS: tl.constexpr):
    """Programs below PROGRAMS read WORDS words of their own row of kv (4 KB a load); the rest nothing."""
    if pid < PROGRAMS:
        ptrs = kv_ptr + pid * WORDS + tl.arange(0, 1024)
        part = tl.zeros((1024,), tl.float32)
        for c in range(0, WORDS, 1024):
            part += tl.load(ptrs + c)
        tot += tl.sum(part, 0)
    return tot


@triton.jit
def _lane0_acquire(bar_ptr, NT: tl.constexpr):
    """The counter as one acquiring load by the program's first thread, shared with the others (a max)."""
    lane = tl.arange(0, NT)
    v = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.u32 p, $2, 0; mov.u32 $0, 0; @p ld.acquire.gpu.global.u32 $0, [$1]; }",
        "=r,l,r", [bar_ptr + lane * 0, lane], dtype=tl.int32, is_pure=False, pack=1)
    return tl.max(v, 0)


@triton.jit
def _arrive(bar_ptr, ON: tl.constexpr):
    """Arrive at the grid barrier: this program's earlier writes are visible to whoever sees the count."""
    if ON:
        tl.debug_barrier()
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(bar_ptr, target, ON: tl.constexpr, POLL: tl.constexpr, NT: tl.constexpr):
    """Wait until the counter (which only grows in the launch) reaches `target`. POLL 0: acquiring atomics by
    one thread of the program; 2: acquiring loads by the first thread. A grid not resident at once would wait
    forever: after 2**16 reads the wait gives up and says so in bar[1]."""
    if ON:
        spins = 0
        if POLL == 0:
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
            while (seen < target) & (spins < 1 << 16):
                seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
                spins += 1
        else:
            seen = _lane0_acquire(bar_ptr, NT)
            while (seen < target) & (spins < 1 << 16):
                seen = _lane0_acquire(bar_ptr, NT)
                spins += 1
        if seen < target:
            tl.store(bar_ptr + 1, 1)


@triton.jit
def _sync(bar_ptr, target, pre, w_next, pid, P, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr,
          PRE: tl.constexpr, ON: tl.constexpr, POLL: tl.constexpr, NT: tl.constexpr, SPLIT: tl.constexpr):
    """A grid barrier; with PRE > 0 the program also requests its first PRE units of the weight at w_next
    ([N, W]) and returns them: before it arrives, or (SPLIT) between arriving and waiting, so that the loads
    overlap the wait (an arrival releases, so loads requested before it are waited for first)."""
    if PRE > 0 and not SPLIT:
        pre = _group(w_next, 0, pid, P, N, W, BN, PRE)
    _arrive(bar_ptr, ON)
    if PRE > 0 and SPLIT:
        pre = _group(w_next, 0, pid, P, N, W, BN, PRE)
    _wait(bar_ptr, target, ON, POLL, NT)
    return pre


@triton.jit
def _layers(w_ptr, kv_ptr, out_ptr, tot_ptr, bar_ptr, P, L,
            N0: tl.constexpr, W0: tl.constexpr, N1: tl.constexpr, W1: tl.constexpr,
            N2: tl.constexpr, W2: tl.constexpr, N3: tl.constexpr, W3: tl.constexpr,
            O1: tl.constexpr, O2: tl.constexpr, O3: tl.constexpr, LW: tl.constexpr, KVW: tl.constexpr,
            BN: tl.constexpr, D: tl.constexpr, BARRIER: tl.constexpr, PRE: tl.constexpr, SPLIT: tl.constexpr,
            SMALL: tl.constexpr, NORM_W: tl.constexpr, ATTN_P: tl.constexpr, ATTN_W: tl.constexpr,
            POLL: tl.constexpr, READ: tl.constexpr, NT: tl.constexpr):
    """The whole step in one launch, a layer being
        [norm, sync] q/k/v, sync(o) [attention, sync] o, sync(gate/up) [norm, sync] gate/up, sync(down) down,
        sync(next q/k/v)
    where sync(X) also requests the first PRE units of X's words (PRE 0: nothing early) and [..] are the small
    phases (SMALL). [N_i, W_i]: the four weights' shapes in words; O_i: where weight i starts in a layer's LW
    words; KVW: a layer's words of the small phases' data."""
    pid = tl.program_id(0)
    BPL: tl.constexpr = 7 if SMALL else 4          # barriers a layer
    acc = tl.zeros((BN, 32), tl.float32)
    tot = tl.full((), 0.0, tl.float32)
    PB: tl.constexpr = PRE if PRE > 0 else 1
    pre = tl.zeros((PB, BN, 32), tl.float32)
    if PRE > 0:
        pre = _group(w_ptr, 0, pid, P, N0, W0, BN, PRE)
    for layer in range(L):
        wl = w_ptr + layer * LW           # < 2**31 words for 32 layers of the 8B
        kvl = kv_ptr + layer * KVW
        b = layer * BPL
        if SMALL:
            tot = _small(kvl, tot, pid, 1, NORM_W)
            b += 1
            _sync(bar_ptr, b * P, pre, wl, pid, P, N0, W0, BN, 0, BARRIER, POLL, NT, SPLIT)
        acc = _phase(wl, acc, pre, pid, P, N0, W0, BN, D, PRE, READ)
        b += 1
        pre = _sync(bar_ptr, b * P, pre, wl + O1, pid, P, N1, W1, BN, PRE, BARRIER, POLL, NT, SPLIT)
        if SMALL:
            tot = _small(kvl + NORM_W, tot, pid, ATTN_P, ATTN_W)
            b += 1
            _sync(bar_ptr, b * P, pre, wl, pid, P, N0, W0, BN, 0, BARRIER, POLL, NT, SPLIT)
        acc = _phase(wl + O1, acc, pre, pid, P, N1, W1, BN, D, PRE, READ)
        b += 1
        pre = _sync(bar_ptr, b * P, pre, wl + O2, pid, P, N2, W2, BN, PRE, BARRIER, POLL, NT, SPLIT)
        if SMALL:
            tot = _small(kvl + NORM_W + ATTN_P * ATTN_W, tot, pid, 1, NORM_W)
            b += 1
            _sync(bar_ptr, b * P, pre, wl, pid, P, N0, W0, BN, 0, BARRIER, POLL, NT, SPLIT)
        acc = _phase(wl + O2, acc, pre, pid, P, N2, W2, BN, D, PRE, READ)
        b += 1
        pre = _sync(bar_ptr, b * P, pre, wl + O3, pid, P, N3, W3, BN, PRE, BARRIER, POLL, NT, SPLIT)
        acc = _phase(wl + O3, acc, pre, pid, P, N3, W3, BN, D, PRE, READ)
        b += 1                            # the next layer's q/k/v: the spare layer of words past the last
        pre = _sync(bar_ptr, b * P, pre, wl + LW, pid, P, N0, W0, BN, PRE, BARRIER, POLL, NT, SPLIT)
    tl.store(out_ptr + pid * BN + tl.arange(0, BN), tl.sum(acc, 1))
    tl.store(tot_ptr + pid, tot)


@triton.jit
def _spin(ptr, target, NT: tl.constexpr):
    """Every thread reads the counter at ptr with acquiring loads until it reaches `target` (no read where target
    is 0) or 2**20 reads have passed, in assembly: no control flow of the compiler's own, so a software-pipelined
    loop may hold it. Returns the count the program saw (the least of its threads')."""
    lane = tl.arange(0, NT)
    seen = tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 n; mov.u32 n, 0; mov.u32 $0, $2; setp.eq.u32 p, $2, 0; @p bra DONE${:uid};\n"
        "SPIN${:uid}: ld.acquire.gpu.global.u32 $0, [$1];\n"
        "setp.lt.u32 p, $0, $2; add.u32 n, n, 1; setp.lt.and.u32 p, n, 1048576, p; @p bra SPIN${:uid};\n"
        "DONE${:uid}: }",
        "=r,l,r", [ptr + lane * 0, target + lane * 0], dtype=tl.int32, is_pure=False, pack=1)
    return tl.min(seen, 0)


@triton.jit
def _cta_sync(on, NT: tl.constexpr):
    """`bar.sync 0` where `on` (the same in every thread) is nonzero, in assembly (the compiler's own barrier
    stops it software-pipelining the loop around it)."""
    lane = tl.arange(0, NT)
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.u32 p, $2, 0; @p bar.sync 0; mov.b32 $0, $1; }", "=r,r,r",
                              [lane, on + lane * 0], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _layers_flat(w_ptr, kv_ptr, out_ptr, tot_ptr, bar_ptr, P, L,
                 N0: tl.constexpr, W0: tl.constexpr, N1: tl.constexpr, W1: tl.constexpr,
                 N2: tl.constexpr, W2: tl.constexpr, N3: tl.constexpr, W3: tl.constexpr,
                 O1: tl.constexpr, O2: tl.constexpr, O3: tl.constexpr, LW: tl.constexpr, KVW: tl.constexpr,
                 BN: tl.constexpr, STAGES: tl.constexpr, BARRIER: tl.constexpr, SMALL: tl.constexpr,
                 NORM_W: tl.constexpr, ATTN_P: tl.constexpr, ATTN_W: tl.constexpr, NT: tl.constexpr):
    """The step with the weights' reads software-pipelined across the barriers. Programs below P stream: one loop
    over their units of every phase of every layer, STAGES - 1 units requested ahead (the compiler's asynchronous
    copies into shared memory), so the next phase's words are in flight before the barrier that opens it. With
    SMALL, ATTN_P more programs run the small phases (a norm on the first of them, the attention on all), each
    after the projection before it, while the streaming programs wait for them at the next projection's first
    unit. Two counters: bar[0] counts the streaming programs' phase ends, bar[2] the small programs' (bar[1]:
    a wait gave up)."""
    pid = tl.program_id(0)
    acc = tl.zeros((BN, 32), tl.float32)
    tot = tl.full((), 0.0, tl.float32)
    gave_up = False
    if pid < P:
        n0 = ((N0 // BN) * (W0 // 32) - pid + P - 1) // P
        n1 = ((N1 // BN) * (W1 // 32) - pid + P - 1) // P
        n2 = ((N2 // BN) * (W2 // 32) - pid + P - 1) // P
        n3 = ((N3 // BN) * (W3 // 32) - pid + P - 1) // P
        e0 = n0
        e1 = e0 + n1
        e2 = e1 + n2
        T = e2 + n3
        UW: tl.constexpr = BN * 32                 # a unit's words, contiguous: unit u of a weight at u * UW
        tile = tl.arange(0, BN)[:, None] * 32 + tl.arange(0, 32)[None, :]
        j = 0                                      # the unit's place in its layer (carried: no division)
        layer = 0
        base = w_ptr                               # its layer's first word
        for it in tl.range(0, L * T, num_stages=STAGES):
            phase = (j >= e0).to(tl.int32) + (j >= e1).to(tl.int32) + (j >= e2).to(tl.int32)
            i = j - tl.where(phase == 0, 0, tl.where(phase == 1, e0, tl.where(phase == 2, e1, e2)))
            off = tl.where(phase == 0, 0, tl.where(phase == 1, O1, tl.where(phase == 2, O2, O3)))
            words = tl.load(base + off + (pid + i * P).to(tl.int64) * UW + tile).to(tl.float32, bitcast=True)
            if BARRIER:
                opens = i == 0
                _cta_sync(opens.to(tl.int32), NT)   # the program's work before the arrival is done (its stores)
                tl.atomic_add(bar_ptr, 1, mask=opens & ((layer > 0) | (phase > 0)), sem="release", scope="gpu")
                if SMALL:       # after a small phase (before q/k/v, o, gate/up): the small programs' count
                    small = phase < 3
                    target = tl.where(small, (3 * layer + phase + 1) * ATTN_P, (4 * layer + 3) * P)
                    ptr = tl.where(small, bar_ptr + 2, bar_ptr)
                else:
                    target = (4 * layer + phase) * P
                    ptr = bar_ptr
                target = tl.where(opens, target, 0)
                gave_up = gave_up | (_spin(ptr, target, NT) < target)
            j += 1
            wrap = j == T
            base += tl.where(wrap, LW, 0)
            layer += wrap.to(tl.int32)
            j = tl.where(wrap, 0, j)
            acc += words
    else:
        q = pid - P
        for layer in range(L):
            kvl = kv_ptr + layer * KVW
            for ph in tl.static_range(3):          # norm, attention, norm: after q/k/v's x, q/k/v, o
                target = (4 * layer + ph) * P
                if BARRIER:
                    gave_up = gave_up | (_spin(bar_ptr, target, NT) < target)
                if ph == 1:
                    tot = _small(kvl + NORM_W, tot, q, ATTN_P, ATTN_W)
                else:
                    tot = _small(kvl + (ph // 2) * (NORM_W + ATTN_P * ATTN_W), tot, q, 1, NORM_W)
                if BARRIER:
                    tl.debug_barrier()
                    tl.atomic_add(bar_ptr + 2, 1, sem="release", scope="gpu")
    tl.store(out_ptr + pid * BN + tl.arange(0, BN), tl.sum(acc, 1))
    tl.store(tot_ptr + pid, tot)
    tl.store(bar_ptr + 1, 1, mask=gave_up)


@triton.jit
def _one_phase(w_ptr, out_ptr, P, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
               PRE: tl.constexpr, USE_PDL: tl.constexpr):
    """One projection's words as a launch of its own (its first PRE units read before the wait)."""
    pid = tl.program_id(0)
    PB: tl.constexpr = PRE if PRE > 0 else 1
    pre = tl.zeros((PB, BN, 32), tl.float32)
    if PRE > 0:
        pre = _group(w_ptr, 0, pid, P, N, W, BN, PRE)
    wait_then_release(USE_PDL)
    acc = _phase(w_ptr, tl.zeros((BN, 32), tl.float32), pre, pid, P, N, W, BN, D, PRE)
    tl.atomic_add(out_ptr + pid * BN + tl.arange(0, BN), tl.sum(acc, 1))


@triton.jit
def _one_tile(w_ptr, out_ptr, N: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
              PRE: tl.constexpr, USE_PDL: tl.constexpr):
    """One projection's words as the engine's one-row kernels take them: a program a [BN rows, a SPLIT-th of the
    row's 32-word blocks] tile (grid N / BN x SPLIT), a block a loop step, its first PRE blocks read before the
    wait."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    BLOCKS: tl.constexpr = W // 32
    PER: tl.constexpr = (BLOCKS + SPLIT - 1) // SPLIT
    b_lo = pid_k * PER
    b_hi = tl.minimum(b_lo + PER, BLOCKS)
    rows = pid_n * BN + tl.arange(0, BN)
    base = w_ptr + rows.to(tl.int64)[:, None] * W + tl.arange(0, 32)[None, :]
    acc = tl.zeros((BN, 32), tl.float32)
    for i in tl.static_range(PRE):
        ok = tl.full((BN, 32), b_lo + i, tl.int32) < b_hi
        acc += tl.load(base + (b_lo + i) * 32, mask=ok, other=0).to(tl.float32, bitcast=True)
    wait_then_release(USE_PDL)
    for b in range(b_lo + PRE, b_hi):
        acc += tl.load(base + b * 32).to(tl.float32, bitcast=True)
    tl.atomic_add(out_ptr + rows, tl.sum(acc, 1))


@triton.jit
def _one_small(kv_ptr, tot_ptr, PROGRAMS: tl.constexpr, WORDS: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    wait_then_release(USE_PDL)
    tl.atomic_add(tot_ptr + pid, _small(kv_ptr, tl.full((), 0.0, tl.float32), pid, PROGRAMS, WORDS))
