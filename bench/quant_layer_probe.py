"""Whether one persistent launch a decode step could stream a 4-bit 8B's weights faster than a chain of launches.

Issue 16's batch-1 goals leave ~40 us a layer; the engine takes ~54 (docs/quantization.md, "What the batch-1
goals need"). The one way left on paper is a persistent kernel: every program stays resident for the whole
step, the phases of a layer are separated by grid barriers instead of launch boundaries, and programs that have
nothing to do in a phase (a norm runs on one program, the attention on eight) read the next projection's first
words meanwhile. This probe measures that structure before anyone builds it, with loads and no arithmetic (the
words summed as floats, as in bench/quant_gemv_probe.py), over 32 layers of the 8B's packed 4-bit words
(q/k/v, o, gate/up, down):

  launches      one launch a phase, P programs each (P = SMs x programs an SM), programmatic dependent launches
                that wait, then read (the engine's chain, with the same reads);
  launches_early  the same, each launch reading its first `early_units` units of words before its wait;
  persistent    one launch of P programs for the step; a grid barrier (an atomic counter) between phases;
  preload       that, each program requesting its first units of the next projection before it arrives at the
                barrier (at the barrier before a small phase, so that the reads span it);
  preload_split the same requested after arriving and before waiting (an arrival releases: loads requested
                before it are completed first);
  stream        one launch, no barriers: the ceiling of the structure (what the word reads cost alone);
  barriers      the barriers (and small phases) alone, no words;
  pipelined     one launch whose streaming programs (one an SM) run a single loop over all their units of the
                step, software-pipelined `depth` - 1 units ahead through shared memory, so that the next phase's
                words are in flight across the barrier; the small phases run on programs of their own.

Each runs without and with "small" phases, three a layer where few programs work (a norm: one program reads
8 KB; the attention: eight programs read 256 KB each, 512 tokens of a KV head; the second norm), as in a real
layer. Within a phase a program takes every P-th unit ([block_n rows, 32 words]), `depth` units a load.

    python3 bench/quant_layer_probe.py --commit "$(git rev-parse --short HEAD)" --out bench/results/layer_probe.json
    TRITON_INTERPRET=1 python3 bench/quant_layer_probe.py --smoke --out /tmp/p.json   # the script on CPU, no barriers
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from multi_lora import copy_bandwidth  # noqa: E402  (bench helpers)
from quant_kernel_sweep import SHAPES_8B  # noqa: E402
from kernels.pdl import launch_args, wait_then_release  # noqa: E402
from compute_service.engine.cuda_graphs import median_replay_ms  # noqa: E402

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
            BN: tl.constexpr, D: tl.constexpr, BARRIER: tl.constexpr, PRE: tl.constexpr, SPLIT: tl.constexpr,
            SMALL: tl.constexpr, NORM_W: tl.constexpr, ATTN_P: tl.constexpr, ATTN_W: tl.constexpr,
            POLL: tl.constexpr, READ: tl.constexpr, NT: tl.constexpr):
    """The whole step in one launch, a layer being
        [norm, sync] q/k/v, sync(o) [attention, sync] o, sync(gate/up) [norm, sync] gate/up, sync(down) down,
        sync(next q/k/v)
    where sync(X) also requests the first PRE units of X's words (PRE 0: nothing early) and [..] are the small
    phases (SMALL)."""
    pid = tl.program_id(0)
    O1: tl.constexpr = N0 * W0
    O2: tl.constexpr = O1 + N1 * W1
    O3: tl.constexpr = O2 + N2 * W2
    LW: tl.constexpr = O3 + N3 * W3
    KVW: tl.constexpr = 2 * NORM_W + ATTN_P * ATTN_W
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
def _cta_sync(NT: tl.constexpr):
    """`bar.sync 0` in assembly (the compiler's own barrier stops it software-pipelining the loop around it)."""
    tl.inline_asm_elementwise("bar.sync 0;\n mov.b32 $0, $1;", "=r,r", [tl.arange(0, NT)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _layers_flat(w_ptr, kv_ptr, out_ptr, tot_ptr, bar_ptr, P, L,
                 N0: tl.constexpr, W0: tl.constexpr, N1: tl.constexpr, W1: tl.constexpr,
                 N2: tl.constexpr, W2: tl.constexpr, N3: tl.constexpr, W3: tl.constexpr,
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
    O1: tl.constexpr = N0 * W0
    O2: tl.constexpr = O1 + N1 * W1
    O3: tl.constexpr = O2 + N2 * W2
    LW: tl.constexpr = O3 + N3 * W3
    KVW: tl.constexpr = 2 * NORM_W + ATTN_P * ATTN_W
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
        rows = tl.arange(0, BN)
        cols = tl.arange(0, 32)
        for it in tl.range(0, L * T, num_stages=STAGES):
            layer = it // T
            j = it - layer * T
            phase = (j >= e0).to(tl.int32) + (j >= e1).to(tl.int32) + (j >= e2).to(tl.int32)
            i = j - tl.where(phase == 0, 0, tl.where(phase == 1, e0, tl.where(phase == 2, e1, e2)))
            W = tl.where(phase == 0, W0, tl.where(phase == 1, W1, tl.where(phase == 2, W2, W3)))
            C = W // 32
            off = tl.where(phase == 0, 0, tl.where(phase == 1, O1, tl.where(phase == 2, O2, O3)))
            u = pid + i * P
            tile = u // C
            chunk = u - tile * C
            ptrs = (w_ptr + layer * LW + off + (tile * BN + rows).to(tl.int64)[:, None] * W + chunk * 32
                    + cols[None, :])
            words = tl.load(ptrs).to(tl.float32, bitcast=True)
            if BARRIER:
                opens = i == 0
                _cta_sync(NT)       # the program's work before the arrival is done (its stores, in a real kernel)
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
def _one_small(kv_ptr, tot_ptr, PROGRAMS: tl.constexpr, WORDS: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    wait_then_release(USE_PDL)
    tl.atomic_add(tot_ptr + pid, _small(kv_ptr, tl.full((), 0.0, tl.float32), pid, PROGRAMS, WORDS))


MODES = ("launches", "launches_early", "persistent", "preload", "preload_split", "stream", "barriers", "pipelined")
PERSISTENT = ("persistent", "preload", "preload_split", "barriers", "pipelined")


def shapes(smoke: bool) -> list[tuple[int, int]]:
    """[N, W] (rows, int32 words a row) of q/k/v, o, gate/up, down."""
    if smoke:
        return [(128, 192), (64, 128), (256, 64), (64, 256)]
    return [(n, k // 8) for n, k in SHAPES_8B.values()]


def small_sizes(smoke: bool) -> tuple[int, int, int]:
    return (1024, 2, 2048) if smoke else (NORM_WORDS, ATTN_PROGRAMS, ATTN_WORDS)


class Step:
    """One step's buffers and its launches for a mode and config."""

    def __init__(self, dev: torch.device, layers: int, smoke: bool):
        self.dev, self.layers, self.smoke = dev, layers, smoke
        self.shapes = shapes(smoke)
        self.layer_words = sum(n * w for n, w in self.shapes)
        self.norm_w, self.attn_p, self.attn_w = small_sizes(smoke)
        self.kv_words = 2 * self.norm_w + self.attn_p * self.attn_w
        # randn floats seen as words: the sums stay finite; one spare layer for the last preload
        self.w = torch.randn((layers + 1) * self.layer_words, device=dev).view(torch.int32)
        self.kv = torch.randn(layers * self.kv_words, device=dev)
        self.bar = torch.zeros(3, dtype=torch.int32, device=dev)    # counts, gave up, small programs' count

    def weight_bytes(self) -> int:
        return self.layers * self.layer_words * 4

    def layers_kw(self, mode: str, small: bool, bn: int, depth: int, warps: int, poll: int, pre: int) -> dict:
        """The persistent kernel's constexprs for a mode (barriers: the barriers and small phases, no words)."""
        return dict(BN=bn, D=depth, BARRIER=mode != "stream" and self.dev.type == "cuda",
                    PRE=pre if mode.startswith("preload") else 0, SPLIT=mode == "preload_split", SMALL=small,
                    NORM_W=self.norm_w, ATTN_P=self.attn_p, ATTN_W=self.attn_w, POLL=poll,
                    READ=int(mode != "barriers"), NT=warps * 32, num_warps=warps)

    def flat_kw(self, small: bool, bn: int, stages: int, warps: int) -> dict:
        """`_layers_flat`'s constexprs (`stages` in the configs' depth column)."""
        return dict(BN=bn, STAGES=stages, BARRIER=self.dev.type == "cuda", SMALL=small, NORM_W=self.norm_w,
                    ATTN_P=self.attn_p, ATTN_W=self.attn_w, NT=warps * 32, num_warps=warps)

    def launches(self, mode: str, small: bool, programs: int, bn: int, depth: int, warps: int, poll: int,
                 pre: int, out: torch.Tensor, tot: torch.Tensor) -> list:
        """The step as callables, in order."""
        pdl = launch_args(self.dev.type == "cuda")
        if mode == "pipelined":
            flat = [v for s in self.shapes for v in s]
            kw = self.flat_kw(small, bn, depth, warps)

            def run_flat() -> None:
                self.bar[0::2].zero_()
                _layers_flat[(programs + (self.attn_p if small else 0),)](self.w, self.kv, out, tot, self.bar,
                                                                           programs, self.layers, *flat, **kw)
            return [run_flat]
        if mode not in ("launches", "launches_early"):
            flat = [v for s in self.shapes for v in s]
            kw = self.layers_kw(mode, small, bn, depth, warps, poll, pre)

            def run() -> None:
                self.bar[0].zero_()
                _layers[(programs,)](self.w, self.kv, out, tot, self.bar, programs, self.layers, *flat, **kw)
            return [run]
        fns = []
        offs = [0]
        for n, w in self.shapes:
            offs.append(offs[-1] + n * w)
        for layer in range(self.layers):
            wl, kvl = layer * self.layer_words, layer * self.kv_words

            def proj(i: int, wl=wl) -> None:
                n, w = self.shapes[i]
                _one_phase[(programs,)](self.w[wl + offs[i]:], out, programs, n, w, BN=bn, D=depth,
                                        PRE=pre if mode == "launches_early" else 0, num_warps=warps, **pdl)

            def norm(at: int) -> None:
                _one_small[(1,)](self.kv[at:], tot, 1, self.norm_w, num_warps=4, **pdl)

            def attn(kvl=kvl) -> None:
                _one_small[(self.attn_p,)](self.kv[kvl + self.norm_w:], tot, self.attn_p, self.attn_w,
                                           num_warps=4, **pdl)
            at2 = kvl + self.norm_w + self.attn_p * self.attn_w
            fns += ([lambda kvl=kvl: norm(kvl)] if small else []) + [lambda p=proj: p(0)] + ([attn] if small else [])
            fns += [lambda p=proj: p(1)] + ([lambda a=at2: norm(a)] if small else [])
            fns += [lambda p=proj: p(2), lambda p=proj: p(3)]
        return fns

    def check(self, out: torch.Tensor, tot: torch.Tensor, small: bool, words: bool) -> None:
        """Every word (where read) and (with the small phases) every KV value was read once."""
        want = self.w[:self.layers * self.layer_words].view(torch.float32).double().sum()
        got = out.double().sum()
        assert not words or torch.allclose(got, want, rtol=1e-3, atol=1.0), f"words read wrong: {got} against {want}"
        if small:
            want, got = self.kv.double().sum(), tot.double().sum()
            assert torch.allclose(got, want, rtol=1e-3, atol=1.0), f"KV read wrong: {got} against {want}"


def fits(step: Step, mode: str, small: bool, programs: int, bn: int, depth: int, warps: int, poll: int, pre: int,
         out: torch.Tensor, tot: torch.Tensor) -> str | None:
    """Why the persistent grid might not be resident at once (the barrier would then never open), or None. The
    kernel is compiled with the launch's own arguments (Triton specializes on integers equal to 1, so a stand-in
    program count would compile another kernel)."""
    flat = [v for s in step.shapes for v in s]
    programs_per_sm = programs // torch.cuda.get_device_properties(step.dev).multi_processor_count
    if mode == "pipelined":            # a small-phase program may share an SM with a streaming one
        programs_per_sm += int(small)
        grid = (programs + (step.attn_p if small else 0),)
        k = _layers_flat.warmup(step.w, step.kv, out, tot, step.bar, programs, step.layers, *flat,
                                **step.flat_kw(small, bn, depth, warps), grid=grid)
    else:
        k = _layers.warmup(step.w, step.kv, out, tot, step.bar, programs, step.layers, *flat,
                           **step.layers_kw(mode, small, bn, depth, warps, poll, pre), grid=(programs,))
    k._init_handles()                  # loads the binary: its register count is known from then on
    regs = k.n_regs * warps * 32 * programs_per_sm
    smem = (k.metadata.shared + 1024) * programs_per_sm        # the driver keeps 1 KB a program
    if regs > 65536 or smem > 228 * 1024 or warps * programs_per_sm > 64:
        return f"{k.n_regs} registers, {k.metadata.shared} B shared a program"
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1), no barriers")
    ap.add_argument("--modes", default=",".join(MODES), help="which of " + ", ".join(MODES))
    ap.add_argument("--configs", default="", help="semicolon-separated per_sm,block_n,depth,warps,poll,early_units "
                    "(pipelined: depth is the stages)")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    layers = 2 if args.smoke else args.layers
    step = Step(dev, layers, args.smoke)
    sms = 4 if args.smoke else torch.cuda.get_device_properties(dev).multi_processor_count
    bw = None if args.smoke else copy_bandwidth(dev, 2**31)
    res: dict = {"device": "cpu" if args.smoke else torch.cuda.get_device_name(dev), "commit": args.commit,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "layers": layers, "sms": sms, "copy_bandwidth_Bps": bw, "weight_bytes": step.weight_bytes(),
                 "floor_us_per_layer": step.weight_bytes() / bw * 1e6 / layers if bw else None,
                 "small_phases": dict(norm_words=step.norm_w, attn_programs=step.attn_p, attn_words=step.attn_w),
                 "cases": []}
    # (programs an SM, block_n, units a load, warps, how waits poll, units read early)
    configs = [(1, 32, 2, 4, 0, 2), (1, 32, 2, 4, 0, 4)] if args.smoke else [
        (4, 64, 2, 8, 0, 2), (2, 64, 2, 8, 0, 4), (2, 64, 2, 8, 0, 8), (1, 128, 4, 16, 0, 4),
        (1, 128, 4, 16, 0, 8), (1, 128, 4, 16, 2, 8), (1, 128, 4, 32, 0, 8)]
    if args.configs:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    for per_sm, bn, depth, warps, poll, pre in configs:
        programs = sms * per_sm
        for small in (False, True):
            for mode in args.modes.split(","):
                case = dict(mode=mode, small=small, programs_per_sm=per_sm, block_n=bn, depth=depth, warps=warps,
                            poll=poll, early_units=pre)
                if poll and mode not in PERSISTENT:       # the same launches as the config with poll 0
                    continue
                extra = step.attn_p if mode == "pipelined" and small else 0      # the small phases' programs
                out = torch.zeros((programs + extra) * bn, device=dev)
                tot = torch.zeros(programs + extra, device=dev)
                why = None if args.smoke or mode not in PERSISTENT else fits(step, mode, small, programs, bn, depth,
                                                                             warps, poll, pre, out, tot)
                if why:
                    res["cases"].append(dict(case, skipped=why))
                    print(case, "skipped:", why, flush=True)
                    continue
                fns = step.launches(mode, small, programs, bn, depth, warps, poll, pre, out, tot)
                for f in fns:
                    f()
                step.check(out, tot, small, words=mode != "barriers")
                us = 0.0
                if not args.smoke and step.bar[1].item():
                    res["cases"].append(dict(case, skipped="a barrier gave up: the grid was not resident at once"))
                    print(case, "skipped: a barrier gave up", flush=True)
                    step.bar[1].zero_()
                    continue
                if not args.smoke:
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for f in fns:
                            f()
                    us = median_replay_ms(g, 10) * 1e3
                row = dict(case, us=us, us_per_layer=us / layers, barrier_gave_up=bool(step.bar[1].item()))
                res["cases"].append(row)
                print(" ".join(f"{k}={v}" for k, v in case.items()), f"{us / layers:.2f} us a layer", flush=True)
        args.out.write_text(json.dumps(res, indent=1))
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
