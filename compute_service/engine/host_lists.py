"""Small host lists (indices, per-row parameters) onto the device without waiting for it."""
from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`. On CUDA through fresh pinned memory (torch keeps it until the copy
    ran): a pageable copy would hold the host until every kernel queued before it is done, delaying the
    hand-off made once a step is queued, or the next overlapped step."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=pinned)
