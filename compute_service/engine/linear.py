"""A base projection as an object: `Linear(x)` is `x @ weight.T + bias`.

The model calls its projections (qkv, o, gate_up, down) through this interface,
so a layer whose weights are stored another way (quantized, sharded) only has to
provide the same call; the LoRA deltas are added to its output by the model.

`dense_linear` is the one dense matmul of the model (projections and the LM head): on CUDA a
single 16-bit row (batch-1 decode) against a large weight runs `kernels.dense_gemv`, which reads the
weight closer to copy bandwidth than the library GEMM does at one row; everything else is `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Weights of at least this many elements and in features take the one-row kernel at batch 1
# (bench/dense_gemv.py, H200: the library call is as fast on small, launch-bound weights, and faster on
# short rows: the default SmolLM2's LM head, 576 in features, 18 against 26 us).
GEMV_MIN_ELEMENTS = 2**22
GEMV_MIN_IN_FEATURES = 1024


def takes_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               any_size: bool = False) -> bool:
    """Whether the one-row GEMV kernel can run these operands: one 16-bit row on CUDA; unless `any_size`,
    also a weight large enough that the kernel beats the library GEMM on its own (`dense_linear`)."""
    return (x.is_cuda and x.numel() == x.shape[-1] and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.stride(1) == 1
            and (any_size or (weight.numel() >= GEMV_MIN_ELEMENTS and weight.shape[1] >= GEMV_MIN_IN_FEATURES))
            and x.stride(-1) == 1
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 addend: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; one row on CUDA in 16 bits against a large weight runs the GEMV kernel.
    `addend` (float32, one row) is added before rounding and left zero; it takes the GEMV kernel whatever
    the weight's size (`takes_gemv(..., any_size=True)`), with `kernels.dense_gemv`'s condition: the call
    follows the launch that wrote the addend, and that launch is worth hiding behind the weight's reads."""
    if takes_gemv(x, weight, bias, any_size=addend is not None):
        from kernels.dense_gemv import dense_gemv

        out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
        dense_gemv(x, weight, bias, out, addend=addend)
        return out
    if addend is not None:
        raise ValueError("an addend takes the one-row GEMV kernel (see takes_gemv)")
    return F.linear(x, weight, bias)


class Linear:
    """Dense weight [N, K] in the model dtype, optional bias [N]; `__call__([T, K]) -> [T, N]`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight             # [N, K]
        self.bias = bias                 # [N] or None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads from memory (weight and bias)."""
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)

    @property
    def input_perm(self) -> None:
        """None: a dense weight reads x in the model's channel order (`QuantLinear.input_perm`)."""
        return None

    @property
    def input_perm_inverse(self) -> None:
        """None, as `input_perm`."""
        return None

    def takes_addend(self, x: torch.Tensor, ordered: bool = False) -> bool:
        """Whether `self(x, addend=...)` is allowed: one 16-bit row on CUDA (the GEMV kernel runs it)."""
        return takes_gemv(x, self.weight, self.bias, any_size=True)

    def sums_width(self, t: int, dtype: torch.dtype, ordered: bool = False) -> int:
        """0: a dense projection reads no sums of x (`QuantLinear.sums_width`)."""
        return 0

    def __call__(self, x: torch.Tensor, addend: torch.Tensor | None = None, beside_lora: bool = False,
                 split_out: bool = False, ordered: bool = False) -> torch.Tensor:
        """[T, N]; `addend` [T, N] float32 is added before rounding and left zero (`dense_linear`). `beside_lora`
        (a LoRA launch runs beside the call, `LlamaModel._project`): no other choice here (the library GEMM);
        `QuantLinear` picks its kernel by it. `split_out` (partials allowed): always a tensor here, nothing
        splits K. `ordered` (x in `input_perm`'s order): the model's order here, there is no other."""
        return dense_linear(x, self.weight, self.bias, addend)
