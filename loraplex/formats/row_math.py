"""The converter's per-row copies and arithmetic, without torch's intra-op threads.

The converter writes rows from several threads at once. A torch op over more
than torch's grain size (32768 elements) starts a team of intra-op threads on
each call, and a few converter threads times a machine's cores of those is
slower than one thread (measured on a 16-core host: 102 ms against 68 ms for a
335 MB adapter). So copies are numpy's (one thread, the GIL released), and
`B * scale` is torch's own kernel applied to slices below the grain size,
which torch runs on the calling thread: the same arithmetic as one
`torch.mul(src, scale)` (product in float32, then rounded to nearest even in
the storage dtype), at torch's vectorized speed (numpy has no bfloat16, and
emulating it costs ~60x more). Where torch runs on one thread anyway (the
cache's conversion worker processes), one call per factor: half the time of
the slices on a 2-core machine (37 -> 19 ms for 56 MB of bfloat16).
"""
from __future__ import annotations

import numpy as np
import torch

_BITS = {torch.float32: np.uint32, torch.float16: np.uint16, torch.bfloat16: np.uint16}
_SIGNED = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_EXPONENT = {torch.float32: 0x7F800000, torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
SLICE_ELEMS = 32704      # below torch's intra-op grain size (32768), a multiple of 64: the op runs on this thread


def _bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw bits as an unsigned numpy view (no copy)."""
    return t.view(_SIGNED[t.dtype]).numpy().view(_BITS[t.dtype])


def copy_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[...] = src, same dtype and shape."""
    np.copyto(_bits(dst), _bits(src))


def scale_into(src: torch.Tensor, scale: float, dst: torch.Tensor) -> None:
    """dst[...] = src * scale, as `torch.mul` computes it; same dtype and shape, both contiguous.
    Scale 1 (lora_alpha = r) copies: the product is the value itself."""
    if scale == 1.0:
        copy_into(src, dst)
        return
    s, d = src.reshape(-1), dst.view(-1)
    if torch.get_num_threads() == 1:     # no intra-op team to start (a conversion worker): one call
        torch.mul(s, scale, out=d)
        return
    for i in range(0, s.numel(), SLICE_ELEMS):
        torch.mul(s[i: i + SLICE_ELEMS], scale, out=d[i: i + SLICE_ELEMS])


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in `t` (a value is one iff its exponent bits are all set)."""
    if t.numel() == 0:
        return True
    mask = _EXPONENT[t.dtype]
    return int(np.bitwise_and(_bits(t), mask).max()) != mask
