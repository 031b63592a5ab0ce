"""Small loops for tests/kernels/test_kernel_sass.py: one reads each block as it loads it, one loads each
block a step ahead into one of two register sets, one is left to the compiler's pipeliner, and one has a
second loop behind a constexpr that defaults to off."""
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
