"""`loraplex.v1.Tensor` <-> torch/numpy: row-major, little-endian bytes.

Used by the client to send inline adapters and by the gateway to read them.
bfloat16 travels as its raw 16-bit patterns (numpy has no bfloat16), so torch
is the in-memory type on the way in.

torch and numpy are imported on first use, not at import: the client imports
this module's users without them and only sending inline tensors needs them.
"""
from __future__ import annotations

import functools
import math
import sys
from typing import TYPE_CHECKING, Any

from loraplex.errors import InvalidArgumentError
from loraplex.v1 import common_pb2

if TYPE_CHECKING:
    import torch


@functools.cache
def _to_torch() -> dict[common_pb2.DType, "torch.dtype"]:
    import torch
    return {common_pb2.FLOAT32: torch.float32, common_pb2.FLOAT16: torch.float16,
            common_pb2.BFLOAT16: torch.bfloat16, common_pb2.INT32: torch.int32, common_pb2.INT64: torch.int64}


@functools.cache
def _from_torch() -> dict["torch.dtype", common_pb2.DType]:
    return {v: k for k, v in _to_torch().items()}


def tensor_to_proto(x: Any) -> common_pb2.Tensor:
    """numpy array or torch tensor -> Tensor (bfloat16 from torch, or numpy `V2` raw bits)."""
    import numpy as np
    import torch

    if isinstance(x, np.ndarray):
        from loraplex.formats.tensors import numpy_to_torch  # reads V2 as bfloat16
        if x.dtype == np.float64:
            x = x.astype(np.float32)
        t = numpy_to_torch(x)
    elif isinstance(x, torch.Tensor):
        t = x.detach().cpu()
    else:
        raise TypeError(f"expected a numpy array or torch tensor, got {type(x).__name__}")
    if t.dtype == torch.float64:
        t = t.to(torch.float32)
    from_torch = _from_torch()
    if t.dtype not in from_torch:
        raise TypeError(f"dtype {t.dtype} cannot travel as a loraplex Tensor "
                        f"(use one of {sorted(str(d) for d in from_torch)})")
    t = t.contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    data = raw.numpy()
    if sys.byteorder != "little":
        data = data.byteswap()
    return common_pb2.Tensor(dtype=from_torch[t.dtype], shape=list(t.shape), data=data.tobytes())


def tensor_from_proto(msg: common_pb2.Tensor, what: str = "tensor") -> "torch.Tensor":
    """Tensor -> CPU torch tensor; InvalidArgumentError naming `what` when malformed."""
    import numpy as np
    import torch

    to_torch = _to_torch()
    if msg.dtype not in to_torch:
        raise InvalidArgumentError(f"{what}: dtype is unset or unknown ({msg.dtype}); "
                                   "set dtype to FLOAT16, BFLOAT16, FLOAT32, INT32 or INT64")
    dtype = to_torch[msg.dtype]
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"{what}: negative dimension in shape {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(msg.data) != expected:
        raise InvalidArgumentError(
            f"{what}: shape {shape} of {common_pb2.DType.Name(msg.dtype)} needs {expected} bytes "
            f"of data, got {len(msg.data)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    raw_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    np_dtype = torch.empty((), dtype=raw_dtype).numpy().dtype.newbyteorder("<")
    arr = np.frombuffer(msg.data, dtype=np_dtype).astype(np_dtype.newbyteorder("="), copy=True)
    t = torch.from_numpy(arr).view(shape)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
