"""`dot`: the one `tl.dot` of the LoRA and quantized-matmul kernels, with the interpreter's bfloat16 bug worked
around.

Triton's interpreter (TRITON_INTERPRET=1: the CPU tests) computes bfloat16 dots wrongly: the raw bit patterns
are multiplied (relative error ~1e9 on a 16 x 16 probe). Interpreted, `dot` therefore takes fp32 operands
(exact: every 16-bit value is one), so the bf16 cases of the CPU tests check the kernels' own arithmetic;
compiled, the operands go to the tensor cores as they are (the generated code is unchanged).
"""
import os

import triton
import triton.language as tl

# A fact of the process (as `kernels.pdl.compiled`), not a setting: read once, at import.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, acc=None):
    if IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _dot_fp32(a, b, IEEE: tl.constexpr, acc=None):
    return _dot(a.to(tl.float32), b.to(tl.float32), IEEE, acc)


# Chosen here rather than by a module-level constexpr inside one function: a helper that reads one gives its
# callers a cache key that depends on which kernel the process hashed first (tests/kernels/test_cache_keys.py).
# dot(a, b, IEEE, acc=None): a @ b (+ acc) accumulated in fp32; IEEE (float32 models) keeps full fp32 products
# instead of TF32's 10-bit mantissa, so a float32 model's results do not depend on which kernel or batch shape
# computed them.
dot = _dot_fp32 if INTERPRETED else _dot
