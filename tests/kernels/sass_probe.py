"""Small loops for tests/kernels/test_kernel_sass.py: one reads each block as it loads it, one loads each
block a step ahead into one of two register sets, one is left to the compiler's pipeliner, one has a
second loop behind a constexpr that defaults to off, and one sums a [64, 32] tile each step along either
axis."""
import triton
import triton.language as tl


@triton.jit
def sum_as_loaded(x_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for b in range(n_blocks):
        acc += tl.load(x_ptr + b * BLOCK + offs)
    tl.store(out_ptr + offs, acc)


@triton.jit
def sum_one_ahead(x_ptr, out_ptr, n_pairs, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    a = tl.load(x_ptr + offs)
    c = tl.load(x_ptr + BLOCK + offs)
    for p in range(n_pairs):
        acc += a
        a = tl.load(x_ptr + (2 * p + 2) * BLOCK + offs)
        tl.debug_barrier()
        acc += c
        c = tl.load(x_ptr + (2 * p + 3) * BLOCK + offs)
        tl.debug_barrier()
    tl.store(out_ptr + offs, acc)


@triton.jit
def sum_pipelined(x_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for b in tl.range(0, n_blocks, num_stages=3):
        acc += tl.load(x_ptr + b * BLOCK + offs)
    tl.store(out_ptr + offs, acc)


@triton.jit
def sum_with_option(x_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr, TWICE: tl.constexpr = False):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for b in range(n_blocks):
        acc += tl.load(x_ptr + b * BLOCK + offs)
    if TWICE:
        for b in range(n_blocks):
            acc += tl.load(x_ptr + b * BLOCK + offs)
    tl.store(out_ptr + offs, acc)


@triton.jit
def tile_sums_each_step(w_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr, AXIS: tl.constexpr):
    """Sums of a [64, 32] tile each step over AXIS: 0, its rows, span the program's 4 warps (summed through
    shared memory); 1, a row lies within one warp (summed by shuffles)."""
    rows = tl.arange(0, 64)
    cols = tl.arange(0, 32)
    acc = tl.zeros((32,) if AXIS == 0 else (64,), dtype=tl.float32)
    for b in range(n_blocks):
        acc += tl.sum(tl.load(w_ptr + b * 2048 + rows[:, None] * 32 + cols[None, :]), axis=AXIS)
    tl.store(out_ptr + tl.arange(0, acc.shape[0]), acc)
