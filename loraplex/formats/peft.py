"""Hugging Face PEFT folders <-> `Adapter`.

Reading follows TensorRT-LLM's `hf_lora_convert.py` and llgtrt's
`extract_lora.py`, so the rows come out the same: tensors are visited in the
file's key order (sorted names for safetensors), rows grouped by layer in
first-seen order, then by module in first-seen order; A is `[r, in]`, B is
`[out, r]` times PEFT's scale; `gate_up_proj` maps to module 5 with the two
halves of B swapped. Unlike those converters, the scale is PEFT's own
per-module scale (`rank_pattern`/`alpha_pattern` honoured), so the converted
rows equal PEFT's `get_delta_weight` exactly.

Writing produces a folder PEFT loads: every row becomes `lora_A`/`lora_B`
with the scale already in B, so `lora_alpha == r` per module (scale 1).
"""
from __future__ import annotations

import json
import pickle
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm  # type: ignore[import-untyped]

from loraplex.formats.adapter import Adapter, AdapterMetadata
from loraplex.formats.errors import (AdapterError, AdapterFormatError, DtypeError,
                                     UnsafeFileError, UnsupportedOptionError)
from loraplex.formats.modules import HF_TO_MODULE_ID, MODULE_ID_TO_HF, MODULE_NAMES
from loraplex.formats.peft_config import PeftLoraConfig, read_peft_config
from loraplex.formats.tensors import STORAGE_DTYPES, storage_dtype

SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<path>(?:.*\.)?layers\.(?P<layer>\d+)\."
                  r"(?P<block>[^.]+)\.(?P<proj>[^.]+))\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def is_peft_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "adapter_config.json").is_file()


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors in file order; `.bin` only through `weights_only=True`."""
    st, bin_ = folder / SAFETENSORS_NAME, folder / BIN_NAME
    if st.is_file():
        try:
            with safe_open(str(st), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise AdapterFormatError(f"{st}: not a readable safetensors file ({e})") from e
    if bin_.is_file():
        try:
            sd = torch.load(bin_, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeFileError(f"{bin_}: refused, it holds objects other than tensors "
                                  f"(loaded with weights_only=True): {str(e).splitlines()[0]}") from e
        except Exception as e:  # truncated zip, bad magic: torch raises RuntimeError/EOFError/...
            raise AdapterFormatError(f"{bin_}: not a readable torch file ({e})") from e
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise AdapterFormatError(f"{bin_}: expected a dict of tensors")
        return sd
    raise AdapterFormatError(f"{folder}: has adapter_config.json but neither {SAFETENSORS_NAME} "
                             f"nor {BIN_NAME}")


def _refuse_key(key: str) -> None:
    """Names the option behind a tensor loraplex cannot serve."""
    if "lora_magnitude_vector" in key:
        raise UnsupportedOptionError("use_dora", f"tensor {key!r} is a DoRA magnitude vector")
    if "lora_embedding_" in key or "lm_head" in key or "embed_tokens" in key:
        raise UnsupportedOptionError("target_modules", f"tensor {key!r} adapts an embedding or "
                                     "lm_head; loraplex adapts only the decoder's linear layers")
    if "lora_B" in key and key.endswith(".bias"):
        raise UnsupportedOptionError("lora_bias", f"tensor {key!r} is a lora_B bias")
    if "lora_" not in key:
        raise UnsupportedOptionError("modules_to_save", f"tensor {key!r} is a full base-model "
                                     "weight, not a LoRA factor")
    raise AdapterFormatError(f"unexpected tensor name {key!r} (expected '...layers.<i>.<block>."
                             "<proj>.lora_A.weight')")


@dataclass
class _Factors:
    """One adapted module's tensors as found in the file."""

    path: str
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None


def _group(sd: dict[str, torch.Tensor], cfg: PeftLoraConfig) -> dict[tuple[int, str], _Factors]:
    """(layer, proj) -> factors, in the converters' order (layer first-seen, then module)."""
    by_layer: dict[int, dict[str, _Factors]] = {}
    for key, t in sd.items():
        m = _KEY.match(key)
        if m is None:
            _refuse_key(key)
            continue
        layer, proj, path = int(m["layer"]), m["proj"], m["path"]
        if proj not in HF_TO_MODULE_ID:
            raise UnsupportedOptionError("target_modules", f"tensor {key!r}: module {proj!r} is "
                                         f"not one of {sorted(HF_TO_MODULE_ID)}")
        if not cfg.targets(path):
            raise AdapterFormatError(f"tensor {key!r} is outside target_modules={cfg.target_modules!r}")
        if cfg.layers_to_transform is not None and layer not in cfg.layers_to_transform:
            raise AdapterFormatError(f"tensor {key!r} is for layer {layer}, outside "
                                     f"layers_to_transform={cfg.layers_to_transform}")
        entry = by_layer.setdefault(layer, {}).setdefault(proj, _Factors(path))
        if m["ab"] == "A":
            entry.a = t
        else:
            entry.b = t
    return {(layer, proj): e for layer, mods in by_layer.items() for proj, e in mods.items()}


def _row(proj: str, path: str, a: torch.Tensor, b: torch.Tensor, cfg: PeftLoraConfig,
         target: torch.dtype) -> tuple[torch.Tensor, int, int, int]:
    """One converted row (A flat, then scaled B flat) with its rank, in and out features."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise AdapterFormatError(f"{path}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                                 "are not [r, in] and [out, r]")
    rank = int(a.shape[0])
    if rank != cfg.rank_for(path):
        raise AdapterFormatError(f"{path}: tensors have rank {rank} but r/rank_pattern give "
                                 f"{cfg.rank_for(path)}")
    for t in (a, b):
        if t.dtype not in STORAGE_DTYPES.values():
            raise DtypeError(f"{path}: LoRA factor dtype {t.dtype} is not float16/bfloat16/float32")
    # same arithmetic as the converters: B * scale in the source dtype, then the storage cast
    b_scaled = b * cfg.scale_for(path)
    if proj == "gate_up_proj":
        half = b_scaled.shape[0] // 2
        b_scaled = torch.cat((b_scaled[half:], b_scaled[:half]), dim=0)
    flat = torch.cat((a.to(target).flatten(), b_scaled.to(target).flatten()))
    return flat, rank, int(a.shape[1]), int(b.shape[0])


def read_peft(path: str | Path, *, dtype: str | torch.dtype | None = None,
              progress: bool = False) -> Adapter:
    """Reads a PEFT folder; `dtype` None keeps the factors' own dtype (as llgtrt does)."""
    folder = Path(path)
    cfg = read_peft_config(folder)
    groups = _group(load_state_dict(folder), cfg)
    if not groups:
        raise AdapterFormatError(f"{folder}: no LoRA tensors found")
    for e in groups.values():
        if e.a is None or e.b is None:
            raise AdapterFormatError(f"{e.path}: lora_{'B' if e.a is not None else 'A'} is missing")
    all_dtypes = [t.dtype for e in groups.values() for t in (e.a, e.b) if t is not None]
    if dtype is not None:
        target = storage_dtype(dtype)
    else:
        target = all_dtypes[0]
        for d in all_dtypes[1:]:
            target = torch.promote_types(target, d)
        if target not in STORAGE_DTYPES.values():
            raise DtypeError(f"{folder}: LoRA factor dtype {target} is not float16/bfloat16/float32")
    flats, config, in_out = [], [], []
    # a bar only for large adapters, and only on a terminal (disable=None)
    quiet = not progress or len(groups) < 64
    for (layer, proj), e in tqdm(groups.items(), desc="converting", unit="module",
                                 disable=True if quiet else None):
        assert e.a is not None and e.b is not None  # checked above
        flat, rank, fin, fout = _row(proj, e.path, e.a, e.b, cfg, target)
        flats.append(flat)
        config.append((HF_TO_MODULE_ID[proj], layer, rank))
        in_out.append((fin, fout))
    width = max(f.numel() for f in flats)
    weights = torch.zeros(len(flats), width, dtype=target)
    for i, f in enumerate(flats):
        weights[i, : f.numel()] = f
    extra = {"r": str(cfg.r), "lora_alpha": str(cfg.lora_alpha), "use_rslora": str(cfg.use_rslora),
             "rank_pattern": json.dumps(cfg.rank_pattern), "alpha_pattern": json.dumps(cfg.alpha_pattern),
             "fan_in_fan_out": str(cfg.fan_in_fan_out), "scale_folded_into_b": "true",
             "base_model_name_or_path": cfg.base_model_name_or_path}
    return Adapter(config=np.asarray(config, dtype=np.int32).reshape(-1, 3), weights=weights,
                   in_out=tuple(in_out),
                   metadata=AdapterMetadata(source=str(folder), original_format="peft", extra=extra))


def write_peft(adapter: Adapter, out_dir: str | Path) -> Path:
    """Writes a PEFT folder (safetensors) PEFT can load; needs `in_out` (validate first)."""
    if not adapter.in_out:
        raise AdapterError("row shapes unknown: validate the adapter against a model before "
                           "writing PEFT (loraplex convert --model CONFIG)")
    ranks = Counter(int(r) for r in adapter.config[:, 2])
    r = ranks.most_common(1)[0][0]
    tensors: dict[str, torch.Tensor] = {}
    targets: list[str] = []
    rank_pattern: dict[str, int] = {}
    for row in adapter.rows():
        name = MODULE_ID_TO_HF.get(row.module_id)
        if name is None:
            raise AdapterError(f"row {row.index}: module {MODULE_NAMES.get(row.module_id, row.module_id)} "
                               "has no Hugging Face Llama name to write")
        block = "self_attn" if row.module_id <= 4 else "mlp"
        path = f"model.layers.{row.layer_idx}.{block}.{name}"
        tensors[f"base_model.model.{path}.lora_A.weight"] = row.a.clone()
        tensors[f"base_model.model.{path}.lora_B.weight"] = row.b.clone()
        targets.append(path)
        if row.rank != r:
            rank_pattern[path] = row.rank
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": r,
        "rank_pattern": rank_pattern, "alpha_pattern": dict(rank_pattern),  # scale 1 everywhere
        "use_rslora": False, "target_modules": targets, "bias": "none", "lora_dropout": 0.0,
        "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
        "base_model_name_or_path": adapter.metadata.extra.get("base_model_name_or_path") or None,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / SAFETENSORS_NAME))
    return out
