"""llgtrt's single `.safetensors`: tensors `weights` `[1, N, W]` and `config` int32 `[N, 3]`.

That is what llgtrt's `extract_lora.py` writes (no `__metadata__`); both tensors
are read with or without a leading 1.
"""
from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from loraplex.formats.adapter import Adapter, AdapterMetadata
from loraplex.formats.errors import AdapterFormatError
from loraplex.formats.tensors import adapter_from_tensors

TENSOR_NAMES = ("weights", "config")


def safetensors_keys(path: str | Path) -> list[str]:
    """Tensor names in a safetensors file (AdapterFormatError if unreadable)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterFormatError(f"{path}: not a readable safetensors file ({e})") from e


def read_llgtrt(path: str | Path) -> Adapter:
    """Reads a `.safetensors` holding `weights` and `config`."""
    keys = safetensors_keys(path)
    missing = [k for k in TENSOR_NAMES if k not in keys]
    if missing:
        raise AdapterFormatError(f"{path}: lacks tensor(s) {missing} (has {sorted(keys)[:6]}); "
                                 "expected llgtrt's form with 'weights' and 'config'")
    try:
        with safe_open(str(path), framework="pt") as f:
            weights, config = f.get_tensor("weights"), f.get_tensor("config")
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterFormatError(f"{path}: cannot read its tensors ({e})") from e
    meta = AdapterMetadata(source=str(path), original_format="safetensors")
    return adapter_from_tensors(weights, config, metadata=meta)


def write_llgtrt(adapter: Adapter, path: str | Path) -> Path:
    """Writes `weights` `[1, N, W]` and `config` int32 `[N, 3]` as llgtrt's extractor does."""
    import torch

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"weights": adapter.weights.unsqueeze(0).contiguous(),
               "config": torch.from_numpy(adapter.config.astype("int32"))}, str(out))
    return out
