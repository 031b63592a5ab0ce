"""One-call loading: detect the format of a path and read it; list adapter folders.

- a folder with `adapter_config.json`: a PEFT adapter;
- a folder with `model.lora_weights.npy` + `model.lora_config.npy`: TensorRT-LLM tensors;
- a `.safetensors` file with `weights` and `config`: llgtrt's form.
Also the two folder layouts read at start: the Triton-style prefetch folder
(`<dir>/<task_id>/`, digits only) and the llgtrt-style adapter root
(`<root>/<name>/` or `<root>/<name>.safetensors`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from loraplex.formats.adapter import Adapter
from loraplex.formats.errors import AdapterFormatError
from loraplex.formats.llgtrt import read_llgtrt, safetensors_keys, write_llgtrt
from loraplex.formats.npy import is_npy_dir, read_npy_dir, write_npy_dir
from loraplex.formats.peft import is_peft_dir, read_peft, write_peft
from loraplex.formats.tensors import cast_adapter

FORMATS = ("peft", "npy", "safetensors")


def detect_format(path: str | Path) -> str:
    """'peft' | 'npy' | 'safetensors' for `path`, or AdapterFormatError saying what was looked for."""
    p = Path(path)
    if is_peft_dir(p):
        return "peft"
    if is_npy_dir(p):
        return "npy"
    if p.is_file() and p.suffix == ".safetensors":
        keys = safetensors_keys(p)
        if "weights" in keys and "config" in keys:
            return "safetensors"
        raise AdapterFormatError(f"{p}: a safetensors file without 'weights' and 'config'; for a "
                                 "PEFT adapter pass its folder (with adapter_config.json)")
    if not p.exists():
        raise AdapterFormatError(f"{p} does not exist")
    raise AdapterFormatError(f"{p}: not an adapter (expected a folder with adapter_config.json, a "
                             "folder with model.lora_weights.npy + model.lora_config.npy, or a "
                             ".safetensors file with 'weights' and 'config')")


def load_adapter(path: str | Path, *, dtype: str | torch.dtype | None = None) -> Adapter:
    """Reads an adapter in any supported format; `dtype` converts the storage dtype."""
    fmt = detect_format(path)
    if fmt == "peft":
        return read_peft(path, dtype=dtype)
    adapter = read_npy_dir(path) if fmt == "npy" else read_llgtrt(path)
    return cast_adapter(adapter, dtype) if dtype is not None else adapter


def save_adapter(adapter: Adapter, path: str | Path, fmt: str) -> Path:
    """Writes `adapter` as 'npy' (folder), 'safetensors' (file) or 'peft' (folder)."""
    if fmt == "npy":
        return write_npy_dir(adapter, path)
    if fmt == "safetensors":
        return write_llgtrt(adapter, path)
    if fmt == "peft":
        return write_peft(adapter, path)
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def list_prefetch_dir(path: str | Path) -> dict[int, Path]:
    """task id -> folder for each `<dir>/<digits>/` holding the .npy pair (others are skipped)."""
    root = Path(path)
    if not root.is_dir():
        raise AdapterFormatError(f"prefetch folder {root} does not exist")
    return {int(p.name): p for p in sorted(root.iterdir())
            if p.name.isdigit() and p.name.isascii() and is_npy_dir(p)}


def list_adapter_root(path: str | Path) -> dict[str, Path]:
    """name -> path for each `<root>/<name>/` adapter folder or `<root>/<name>.safetensors`."""
    root = Path(path)
    if not root.is_dir():
        raise AdapterFormatError(f"adapter root {root} does not exist")
    found: dict[str, Path] = {}
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix == ".safetensors":
            found.setdefault(p.stem, p)
        elif is_peft_dir(p) or is_npy_dir(p):
            found.setdefault(p.name, p)
    return found
