"""TensorRT-LLM's `.npy` pair: `model.lora_weights.npy` + `model.lora_config.npy`.

`hf_lora_convert.py` writes weights `[1, N, W]` in the storage dtype (bfloat16
as raw `V2`, see `tensors.py`) and config int32 `[1, N, 3]`; the Triton
backend's prefetch folder holds the same pair per task id. Both are read with
or without the leading 1 and written with it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from loraplex.formats.adapter import Adapter, AdapterMetadata
from loraplex.formats.errors import AdapterFormatError
from loraplex.formats.tensors import adapter_from_tensors, torch_to_numpy

WEIGHTS_NPY = "model.lora_weights.npy"
CONFIG_NPY = "model.lora_config.npy"


def is_npy_dir(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / WEIGHTS_NPY).is_file() and (p / CONFIG_NPY).is_file()


def _load(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise AdapterFormatError(f"{path} is missing") from None
    except ValueError as e:
        # numpy says "allow_pickle=False" for object arrays and "cannot reshape" for truncation
        raise AdapterFormatError(f"{path}: not a readable .npy tensor ({e})") from e
    except (OSError, EOFError) as e:
        raise AdapterFormatError(f"{path}: not a readable .npy file ({e})") from e


def read_npy_dir(path: str | Path) -> Adapter:
    """Reads a TensorRT-LLM LoRA folder (or a prefetch folder's `<task_id>/`)."""
    p = Path(path)
    if not p.is_dir():
        raise AdapterFormatError(f"{p}: not a folder holding {WEIGHTS_NPY} and {CONFIG_NPY}")
    weights = _load(p / WEIGHTS_NPY)
    config = _load(p / CONFIG_NPY)
    meta = AdapterMetadata(source=str(p), original_format="npy")
    return adapter_from_tensors(weights, config, metadata=meta)


def write_npy_dir(adapter: Adapter, out_dir: str | Path) -> Path:
    """Writes the pair as TensorRT-LLM's converter does: `[1, N, W]` and int32 `[1, N, 3]`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / WEIGHTS_NPY, torch_to_numpy(adapter.weights)[None])
    np.save(out / CONFIG_NPY, np.ascontiguousarray(adapter.config, dtype=np.int32)[None])
    return out
