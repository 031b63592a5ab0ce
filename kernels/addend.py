"""Where a LoRA delta is added to a base projection's output inside another kernel (LlamaModel._project):

- the float32 addend of the one-row base kernels (`dense_gemv`, the 4-bit one-row kernel through
  `quant_split.write_out`): a one-token step's LoRA delta, written into zeros by the launch before them,
  added to the output before rounding and left zero for the next projection;
- the 16-bit `extra` of the kernels that read a projection's output (`rope_cache`, `silu_mul`, `rms_norm`'s
  residual add): a 2-64-token step's LoRA delta, computed on a side stream beside the projection, added to
  what they load as torch adds two 16-bit tensors, instead of a launch of its own between the two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enabled


@triton.jit
def take_addend(total, add_ptrs, mask):
    """total + the addend, which is left zero: every thread holding a copy of an addend element reads it
    before one of them zeroes it (the output's layout may repeat an element over threads)."""
    total += tl.load(add_ptrs, mask=mask, other=0.0)
    tl.debug_barrier()
    tl.store(add_ptrs, tl.zeros_like(total), mask=mask)
    return total


@triton.jit
def with_extra(x, ptrs, mask, EXTRA: tl.constexpr):
    """x + the extra at ptrs (same dtype), rounded to x's dtype as torch's 16-bit add rounds; x without EXTRA."""
    if EXTRA:
        x = (x.to(tl.float32) + tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
    return x


def check_extra(extra: torch.Tensor | None, like: torch.Tensor, name: str, contiguous: bool = False) -> None:
    """`extra` (if any) must be shaped and typed like `like` (the output it is added to), rows contiguous, and
    with `contiguous` (a kernel that indexes it as `like`'s rows, t * width) contiguous as a whole."""
    if extra is not None and (extra.shape != like.shape or extra.dtype != like.dtype or extra.stride(-1) != 1
                              or extra.device != like.device):
        raise ValueError(f"extra must be {like.dtype} {tuple(like.shape)} on {like.device} with contiguous rows "
                         f"like {name}, got {extra.dtype} {tuple(extra.shape)}")
    if contiguous and extra is not None and not extra.is_contiguous():
        raise ValueError("extra must be contiguous")


def extra_pdl(device: torch.device, extra: torch.Tensor | None) -> bool:
    """Whether a kernel that takes `extra` launches as a dependent launch (kernels/pdl.py): not with one, as it
    then follows the join of two streams (the extra's LoRA ran beside the projection), two predecessors."""
    return pdl_enabled(device) and extra is None
