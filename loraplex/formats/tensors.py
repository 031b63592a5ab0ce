"""Raw tensors -> `Adapter`: shape and dtype normalization shared by every format.

Accepted inputs (files and inline request tensors alike):
- weights `[N, W]` or `[1, N, W]`, float16 / bfloat16 / float32 (float64 is
  narrowed to float32), as numpy or torch. numpy has no bfloat16: TensorRT-LLM
  stores bf16 `.npy` as the raw 16-bit patterns with numpy dtype `V2`
  (`np.dtype('V2')`, header descr `'|V2'`); loraplex reads `V2` (and
  ml_dtypes' `bfloat16`) as bfloat16 and writes bfloat16 the same way.
- config `[N, 3]` or `[1, N, 3]`, any integer dtype whose values fit int32.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from loraplex.formats.adapter import Adapter, AdapterMetadata
from loraplex.formats.errors import AdapterFormatError, DtypeError, NonFiniteError

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
NPY_BFLOAT16 = np.dtype("V2")  # how TensorRT-LLM writes bf16 into .npy


def storage_dtype(name: str | torch.dtype) -> torch.dtype:
    """'float16' | 'bfloat16' | 'float32' (or the torch dtype) -> torch dtype."""
    if isinstance(name, torch.dtype):
        if name not in STORAGE_DTYPES.values():
            raise DtypeError(f"storage dtype must be one of {sorted(STORAGE_DTYPES)}, got {name}")
        return name
    key = str(name).removeprefix("torch.")
    if key not in STORAGE_DTYPES:
        raise DtypeError(f"storage dtype must be one of {sorted(STORAGE_DTYPES)}, got {name!r}")
    return STORAGE_DTYPES[key]


def numpy_to_torch(arr: np.ndarray) -> torch.Tensor:
    """numpy -> CPU torch, reading 2-byte void (`V2`) and ml_dtypes bfloat16 as bfloat16."""
    if (arr.dtype.kind == "V" and arr.dtype.itemsize == 2) or arr.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    if arr.dtype.kind == "V" or arr.dtype.hasobject:
        raise DtypeError(f"weights dtype {arr.dtype} is not a float type loraplex can read")
    return torch.from_numpy(np.ascontiguousarray(arr))


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """CPU torch -> numpy; bfloat16 becomes raw `V2` as TensorRT-LLM's converter writes it."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(NPY_BFLOAT16)
    return t.numpy()


def _as_torch(x: Any, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, np.ndarray):
        return numpy_to_torch(x)
    raise AdapterFormatError(f"{what} must be a numpy array or torch tensor, got {type(x).__name__}")


def _drop_leading_one(t: torch.Tensor, ndim: int, what: str, shape_doc: str) -> torch.Tensor:
    if t.dim() == ndim + 1 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != ndim:
        raise AdapterFormatError(f"{what} must have shape {shape_doc} or [1, {shape_doc[1:]}, "
                                 f"got {list(t.shape)}")
    return t


def normalize_config(config: Any) -> np.ndarray:
    """config tensor -> int32 [N, 3] numpy."""
    t = _drop_leading_one(_as_torch(config, "config"), 2, "config", "[N, 3]")
    if t.shape[1] != 3:
        raise AdapterFormatError(f"config must have 3 columns [module_id, layer_idx, rank], "
                                 f"got shape {list(t.shape)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise AdapterFormatError(f"config must be an integer tensor (int32), got {t.dtype}")
    wide = t.to(torch.int64)
    if wide.numel() and (wide.min() < -2**31 or wide.max() >= 2**31):
        raise AdapterFormatError("config values do not fit int32")
    return wide.to(torch.int32).numpy().copy()


def normalize_weights(weights: Any) -> torch.Tensor:
    """weights tensor -> contiguous CPU [N, W] float16/bfloat16/float32."""
    t = _drop_leading_one(_as_torch(weights, "weights"), 2, "weights", "[N, W]")
    if t.dtype == torch.float64:
        t = t.to(torch.float32)
    if t.dtype not in STORAGE_DTYPES.values():
        raise DtypeError(f"weights dtype {t.dtype} is not float16, bfloat16 or float32")
    return t.contiguous()


def adapter_from_tensors(weights: Any, config: Any, *, metadata: AdapterMetadata | None = None,
                         in_out: tuple[tuple[int, int], ...] = ()) -> Adapter:
    """Inline tensors (numpy or torch, `[N, W]`/`[1, N, W]` and `[N, 3]`/`[1, N, 3]`) -> Adapter.

    Only shapes and dtypes are checked here; call `validate` against the model next.
    """
    cfg = normalize_config(config)
    w = normalize_weights(weights)
    if cfg.shape[0] != w.shape[0]:
        raise AdapterFormatError(f"config has {cfg.shape[0]} rows but weights has {w.shape[0]}; "
                                 "each config row describes one weights row")
    meta = metadata or AdapterMetadata(source="inline", original_format="inline")
    return Adapter(config=cfg, weights=w, in_out=in_out, metadata=meta)


def cast_adapter(adapter: Adapter, dtype: str | torch.dtype) -> Adapter:
    """The adapter in storage dtype `dtype`; refuses values that overflow it."""
    target = storage_dtype(dtype)
    if adapter.weights.dtype == target:
        return adapter
    cast = adapter.weights.to(target).contiguous()
    # one reduction on the common path; the [N, W] masks only when something is not finite
    if cast.numel() and not bool(torch.isfinite(cast.abs().amax())):
        bad = torch.isfinite(adapter.weights) & ~torch.isfinite(cast)
        if bool(bad.any()):
            row = int(bad.any(dim=1).nonzero()[0, 0])
            raise NonFiniteError(f"values overflow {target} (largest finite is "
                                 f"{torch.finfo(target).max:g})", row=row)
    return Adapter(config=adapter.config, weights=cast, in_out=adapter.in_out,
                   metadata=adapter.metadata)
