"""Split-K output of the quantized matmul kernels: several programs share one output tile along K.

Each writes its fp32 partial, bumps the tile's counter, and the program that finds itself last sums the
partials in a fixed order (deterministic), adds the bias, writes the output and resets the counter to
zero. No extra launch and no host sync, so it runs inside CUDA graphs; the counters (int32, zero) and the
partials buffer are owned by the caller.

SPLIT is 0 (no split: the output stored), 1 (split, summed in the launch as above) or 2 (`DEFER`: split, each
program's partial stored, the first split's with the bias and the addend, and no sum: the next kernel sums them,
`kernels.split_sum`).
"""
import triton
import triton.language as tl

from kernels.addend import take_addend
from kernels.pdl import gpu_fence

DEFER = 2    # SPLIT's value for partials summed by the next kernel (the kernels compare with the literal)


@triton.jit
def write_out(acc, bias, out_ptr, out_ptrs, part_ptrs, part_stride, mask, lock, pid_k, split_k,
              SPLIT: tl.constexpr, FENCE: tl.constexpr, NUM_THREADS: tl.constexpr, add_ptrs=None,
              ADD: tl.constexpr = False):
    """out = acc + bias (+ the fp32 addend at add_ptrs, left zero: ADD); under split-K via the partials
    (part_stride apart) and the tile's counter `lock`, or (SPLIT == DEFER) the partials alone."""
    if not SPLIT:
        total = acc + bias
        if ADD:
            total = take_addend(total, add_ptrs, mask)
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
    elif SPLIT == 2:                               # DEFER
        if pid_k == 0:
            acc += bias
            if ADD:
                acc = take_addend(acc, add_ptrs, mask)
        tl.store(part_ptrs + pid_k * part_stride, acc, mask=mask)
    else:
        tl.store(part_ptrs + pid_k * part_stride, acc, mask=mask)   # split-K runs only for small T: int32 offsets
        if FENCE:                                  # the partial stores are visible GPU-wide before the count moves
            gpu_fence(NUM_THREADS)
        tl.debug_barrier()                         # every thread's partial is stored before the count
        done = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if done == split_k - 1:                    # the last program of this tile reduces it, in split order
            if FENCE:                              # its loads of the partials come after it saw the count
                gpu_fence(NUM_THREADS)
            total = tl.zeros_like(acc)
            for s in range(split_k):
                total += tl.load(part_ptrs + s * part_stride, mask=mask, other=0.0, cache_modifier=".cg")
            total += bias
            if ADD:
                total = take_addend(total, add_ptrs, mask)
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")
