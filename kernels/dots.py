"""`dot`: the one `tl.dot` of the LoRA and quantized-matmul kernels, with the interpreter's bfloat16 bug worked
around.

Triton's interpreter (TRITON_INTERPRET=1: the CPU tests) computes bfloat16 dots wrongly: the raw bit patterns
are multiplied (relative error ~1e9 on a 16 x 16 probe). Interpreted, `dot` therefore takes fp32 operands
(exact: every 16-bit value is one), so the bf16 cases of the CPU tests check the kernels' own arithmetic;
compiled, the operands go to the tensor cores as they are (INTERPRETED is a compile-time False: the generated
code is unchanged).
"""
import os

import triton
import triton.language as tl

# A fact of the process (as `kernels.pdl.compiled`), not a setting: read once, at import.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def dot(a, b, IEEE: tl.constexpr, acc=None):
    """a @ b (+ acc) accumulated in fp32; IEEE (float32 models) keeps full fp32 products instead of TF32's 10-bit
    mantissa, so a float32 model's results do not depend on which kernel or batch shape computed them."""
    if INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out
