"""Integer switches read from the environment: the kernels' and the engine's A/B and tuning knobs
(`kernels.quant_matmul.tile_tma_override`, `compute_service.engine.model.overlap_tokens`)."""
from __future__ import annotations

import os
from collections.abc import Callable


def env_int(name: str, valid: Callable[[int], bool], expected: str) -> int | None:
    """`name`'s value as an int, None where it is unset or blank; anything else, or a value `valid` refuses, is a
    ValueError naming the variable and `expected` (what a valid value is)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be {expected}, got {raw!r}") from None
    if not valid(value):
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value
