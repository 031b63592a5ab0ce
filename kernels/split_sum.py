"""A split-K projection's output left as its partials, summed by the kernel that reads it next.

Under split-K (`kernels.quant_split`) several programs share an output tile along K; summing their partials
inside the launch costs a chain of memory round trips after the slowest program (store, GPU-scope fence,
counter, fence, loads back: H200, 1.8-2.3 us a one-row projection of the 8B, bench/results/quant_split_cost.json).
Deferred (`quant_matmul(..., defer_split=True)`), every program stores its fp32 partial (the first split's with
the bias and the addend added) and the launch ends; the next kernel (the norm, RoPE + cache, SwiGLU:
`kernels.rms_norm`, `kernels.rope_cache`, `kernels.silu_mul`) reads the partials after its wait and sums them
in split order, then rounds to the model dtype: the value the in-launch sum stores, bit for bit where there is
no bias or addend (with them, they are added first instead of last).

`SplitSum` carries the partials ([S, T, N] float32, S >= 2) to those kernels in place of the output tensor;
`summed_input` gives a kernel's wrapper what it passes (the buffer, S, the split's stride), and `load_input`
is the kernel side.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


class SplitSum:
    """A [T, N] output of `dtype` held as the sum over its first axis of `parts` ([S, T, N] float32, contiguous),
    in that axis' order (split-K's partials, `quant_matmul(..., defer_split=True)`)."""

    def __init__(self, parts: torch.Tensor, dtype: torch.dtype) -> None:
        if parts.dim() != 3 or parts.dtype != torch.float32 or not parts.is_contiguous() or parts.shape[0] < 2:
            raise ValueError(f"parts must be contiguous float32 [S >= 2, T, N], got {parts.dtype} "
                             f"{tuple(parts.shape)}")
        self.parts = parts
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.parts.device

    def dim(self) -> int:
        return 2

    def stride(self, dim: int | None = None):
        """The strides of the [T, N] output's layout (rows contiguous)."""
        strides = (self.shape[1], 1)
        return strides if dim is None else strides[dim]

    def is_contiguous(self) -> bool:
        return True

    def materialize(self) -> torch.Tensor:
        """The [T, N] output as a tensor (the partials summed in order, then rounded): for consumers that are
        not the kernels above (tests, reference paths)."""
        total = self.parts[0].clone()
        for part in self.parts[1:]:
            total += part
        return total.to(self.dtype)


def summed_input(x: torch.Tensor | SplitSum) -> tuple[torch.Tensor, int, int]:
    """(buffer, NPARTS, part_stride) for a kernel reading x through `load_input`: a tensor as it is (0 parts),
    a SplitSum as its partials (S parts, T * N elements apart)."""
    if isinstance(x, SplitSum):
        return x.parts, x.parts.shape[0], x.parts[0].numel()
    return x, 0, 0


@triton.jit
def load_input(ptrs, mask, part_stride, NPARTS: tl.constexpr, DTYPE: tl.constexpr):
    """The input at ptrs (0 where masked): with NPARTS 0 a plain load; else the sum of NPARTS float32 partials
    part_stride elements apart, in order, rounded to DTYPE."""
    if NPARTS == 0:
        v = tl.load(ptrs, mask=mask, other=0.0)
    else:
        total = tl.load(ptrs, mask=mask, other=0.0)
        for s in tl.static_range(1, NPARTS):
            total += tl.load(ptrs + s * part_stride, mask=mask, other=0.0)
        v = total.to(DTYPE)
    return v
