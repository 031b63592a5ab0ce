"""The float32 addend of the one-row base kernels (`dense_gemv`, the 4-bit one-row kernel through
`quant_split.write_out`): a one-token step's LoRA delta, written into zeros by the launch before them,
added to the output before rounding and left zero for the next projection (LlamaModel._project)."""
import triton
import triton.language as tl


@triton.jit
def take_addend(total, add_ptrs, mask):
    """total + the addend, which is left zero: every thread holding a copy of an addend element reads it
    before one of them zeroes it (the output's layout may repeat an element over threads)."""
    total += tl.load(add_ptrs, mask=mask, other=0.0)
    tl.debug_barrier()
    tl.store(add_ptrs, tl.zeros_like(total), mask=mask)
    return total
