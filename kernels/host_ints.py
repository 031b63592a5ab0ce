"""Launch-configuration arithmetic on host ints.

triton.cdiv and triton.next_power_of_2 are constexpr functions: called from Python they cost
microseconds each, and the LoRA wrappers call them several times per launch (hundreds of launches a
step). These are the plain-int versions the wrappers use.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())
