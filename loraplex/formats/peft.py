"""Hugging Face PEFT folders <-> `Adapter`.

Reading (`peft_tensors` groups the factors, `peft_rows` writes the rows)
follows the reference converters,
so the rows come out the same: tensors are visited in the file's key order
(sorted names for safetensors), rows grouped by layer in first-seen order,
then by module in first-seen order; A is `[r, in]`, B is `[out, r]` times
PEFT's scale; `gate_up_proj` maps to module 5 with the two
halves of B swapped. Unlike those converters, the scale is PEFT's own
per-module scale (`rank_pattern`/`alpha_pattern` honoured), so the converted
rows equal PEFT's `get_delta_weight` exactly.

Writing produces a folder PEFT loads: every row becomes `lora_A`/`lora_B`
with the scale already in B, so `lora_alpha == r` per module (scale 1).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.formats.adapter import Adapter
from loraplex.formats.errors import AdapterError
from loraplex.formats.modules import MODULE_ID_TO_HF, MODULE_NAMES
from loraplex.formats.peft_rows import plan_peft
from loraplex.formats.peft_tensors import SAFETENSORS_NAME


def is_peft_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "adapter_config.json").is_file()


def read_peft(path: str | Path, *, dtype: str | torch.dtype | None = None) -> Adapter:
    """Reads a PEFT folder; `dtype` None keeps the factors' own dtype (as llgtrt does)."""
    return plan_peft(path, dtype=dtype).to_adapter()


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
