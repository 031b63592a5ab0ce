"""`loraplex convert` writes the same bytes as TensorRT-LLM's and llgtrt's converters.

The reference below restates those converters' documented behaviour (sorted
tensor names, rows grouped by layer then module in first-seen order, B times
`lora_alpha / r`, zero-padded rows; `.npy` as `[1, N, W]` storage dtype and
int32 `[1, N, 3]`, bf16 as raw `V2`; llgtrt's safetensors `weights`
`[1, N, W]` in the source dtype and int32 `config` `[N, 3]`) so that a change
in loraplex's row order, padding, scaling or file layout fails here.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loraplex.cli import main as cli

IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}


def reference_rows(folder, storage: torch.dtype | None):
    cfg = json.loads((folder / "adapter_config.json").read_text())
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in sorted(f.keys())}
    grouped: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        m = re.match(r".*\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)\.lora_(A|B)\.weight", key)
        grouped.setdefault(int(m[1]), {}).setdefault(m[3], {})[m[4]] = t
    rows, config = [], []
    for layer, mods in grouped.items():
        for name, ab in mods.items():
            dt = storage or ab["A"].dtype
            rows.append(torch.cat([ab["A"].to(dt).flatten(), (ab["B"] * scale).to(dt).flatten()]))
            config.append([IDS[name], layer, ab["A"].shape[0]])
    width = max(x.numel() for x in rows)
    weights = torch.stack([torch.nn.functional.pad(x, (0, width - x.numel())) for x in rows])
    return weights, torch.tensor(config, dtype=torch.int32)


@pytest.mark.parametrize("storage", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("rslora", [False, True])
def test_npy_bytes_match_hf_lora_convert(make_peft, tmp_path, storage, rslora):
    _, folder = make_peft("a", r=4, lora_alpha=8, use_rslora=rslora)
    assert cli.main(["convert", "-i", str(folder), "-o", str(tmp_path / "out"),
                     "--storage-type", storage]) == 0
    weights, config = reference_rows(folder, getattr(torch, storage))
    ref = tmp_path / "ref"
    ref.mkdir()
    w = weights[None]
    w_np = w.view(torch.int16).numpy().view(np.dtype("V2")) if storage == "bfloat16" else w.numpy()
    np.save(ref / "model.lora_weights.npy", w_np)
    np.save(ref / "model.lora_config.npy", config[None].numpy())
    for name in ("model.lora_weights.npy", "model.lora_config.npy"):
        assert (tmp_path / "out" / name).read_bytes() == (ref / name).read_bytes(), name


def test_npy_defaults_to_float16(make_peft, tmp_path):
    _, folder = make_peft("a", r=2, lora_alpha=4)
    assert cli.main(["convert", "--in-file", str(folder), "--out-dir", str(tmp_path / "o")]) == 0
    arr = np.load(tmp_path / "o" / "model.lora_weights.npy")
    assert arr.dtype == np.float16 and arr.ndim == 3 and arr.shape[0] == 1


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_safetensors_bytes_match_extract_lora(make_peft, tmp_path, source):
    _, folder = make_peft("a", dtype=source, r=4, lora_alpha=16)
    out = tmp_path / "my_finetuning.safetensors"
    assert cli.main(["convert", "-i", str(folder), "--out-file", str(out)]) == 0
    weights, config = reference_rows(folder, None)
    save_file({"weights": weights[None].contiguous(), "config": config}, str(tmp_path / "ref.safetensors"))
    assert out.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
