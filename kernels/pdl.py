"""Programmatic dependent launch (Hopper and later): a kernel starts while its predecessor still runs.

A decode step is a chain of ~300 small dependent launches; between two of them the GPU idles for the
next grid's launch and ramp-up. Launched this way (`launch_args`), a kernel's programs start as soon
as every program of the previous kernel has passed its own wait, read what no kernel of the step writes
(weights, the step's metadata), then wait (`wait_then_release`) for the previous kernel's results.

The rules every kernel launched with these options keeps:
- it writes nothing, and reads nothing an earlier kernel of the stream writes, before its wait;
- every program waits, on every path, before it exits: a grid whose programs all left without waiting
  could finish before its predecessor, and the next kernel would then read that predecessor's outputs
  too early;
- it releases its dependents only after its wait, so a kernel's early reads run beside its direct
  predecessor alone.
A kernel launched without the options waits for its predecessor as usual, so launches of either kind
mix freely (library matmuls, torch ops).

One exception to the first rule, for the one-row base kernels that add a LoRA delta (`dense_gemv` and the
4-bit one-row kernel with an `addend`): they read x before their wait, because their caller guarantees
that x was written by a kernel before the launch just before them (the LoRA launch, which writes only the
delta they add after the wait). That is safe: a kernel starts only once every program of its predecessor
has passed that predecessor's wait, so every kernel before the predecessor has completed and its writes
are in L2. L1 is not coherent, so such a kernel first runs `read_early` (a GPU-scope fence by every
thread: a memory barrier and an invalidation of the SM's L1), after which its loads read what L2 holds
and may then be served by L1. On the CPU, in the interpreter, before Hopper, or with
LORAPLEX_PDL=0, or with a driver older than CUDA 12.3, nothing changes: the kernels are compiled
without the wait and launched plainly.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV = "LORAPLEX_PDL"


@triton.jit
def read_input(ptrs, mask, EVEN: tl.constexpr):
    """A kernel's input, 0 where `mask` is false (no mask where EVEN)."""
    if EVEN:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v


@triton.jit
def gpu_fence(NUM_THREADS: tl.constexpr):
    """Every thread of the program runs one GPU-scope fence, `fence.acq_rel.gpu` (on sm_90 a memory barrier,
    `MEMBAR.ALL.GPU`, then an invalidation of the SM's L1, `CCTL.IVALL`). Applied to a tensor of one element
    per thread: applied to a tile, each thread would fence once per element it holds (8-32 fences of a few
    hundred cycles each, measured ~7 us per launch at 8 tokens). Inline assembly: callers run it only when
    compiled (Triton's interpreter runs programs one after another and has no caches)."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu;\n mov.b32 $0, $1;", "=r,r", [tl.arange(0, NUM_THREADS)],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def read_early(ON: tl.constexpr, NUM_THREADS: tl.constexpr):
    """Lets the program read inputs before its wait under the exception above: after this fence no load of
    this SM is served by an L1 line an earlier kernel left, and x is then read through L1 like any input.
    (Before 2026-11-28 such reads bypassed L1 instead, `.cg`: the one-row 4-bit kernel reads x once per
    block of codes, each read then an L2 round trip, and its gate/up launch with an addend took 46.3 us
    against 34.3 without one; 34.6 with this fence, H200, bench/results/read_early_ab.json.) Call it before
    the program's first load (the barrier waits for loads in flight). ON false (the interpreter): nothing."""
    if ON:
        gpu_fence(NUM_THREADS)


@triton.jit
def wait_then_release(USE_PDL: tl.constexpr):
    """Waits for the previous kernel's results, then lets the next kernel start (no-op without PDL)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def compiled() -> bool:
    """Whether Triton compiles the kernels (not its interpreter, TRITON_INTERPRET=1, which runs no inline
    assembly: fences, timers, traps): what launches pass as their COMPILED / FENCE / ASM flags."""
    return os.environ.get("TRITON_INTERPRET", "0") != "1"


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched as programmatic dependent launches."""
    if device.type != "cuda" or not compiled() or os.environ.get(ENV, "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


# Programmatic dependent launches captured in CUDA graphs need a driver of CUDA 12.3 or later.
MIN_DRIVER = 12030


@functools.cache
def _capable(index: int) -> bool:
    if torch.version.hip is not None:     # the wait is NVIDIA's instruction
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9 and driver_supports()


def driver_supports() -> bool:
    """Whether the CUDA driver is new enough (unknown counts as yes: torch builds that cannot say)."""
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    if get is None:
        return True
    try:
        return int(get()) >= MIN_DRIVER
    except (RuntimeError, TypeError, ValueError):
        return True


def launch_args(use_pdl: bool) -> dict[str, bool]:
    """The USE_PDL constexpr and the matching launch keyword, together: a dependent launch always runs the
    kernel compiled with its wait, and a kernel compiled with the wait is always launched that way."""
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl else {"USE_PDL": False}
