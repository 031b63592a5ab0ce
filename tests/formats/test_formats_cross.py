"""Every format reads what the others write; leading 1 optional; inline tensors in every accepted form."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from loraplex.formats import (FORMATS, adapter_from_tensors, cast_adapter, detect_format,
                              list_adapter_root, list_prefetch_dir, load_adapter, read_peft,
                              save_adapter, validate)

NAMES = {"npy": "npy_dir", "safetensors": "a.safetensors", "peft": "peft_dir"}


def _rows(adapter):
    return {(r.module_id, r.layer_idx): (r.rank, r.a, r.b) for r in adapter.rows()}


@pytest.mark.parametrize("src,dst", list(itertools.product(FORMATS, FORMATS)))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_format_reads_the_others(make_peft, tiny_spec, tmp_path, src, dst, dtype):
    _, folder = make_peft("p", r=4, lora_alpha=8, rank_pattern={"k_proj": 2})
    original = validate(read_peft(folder, dtype=dtype), tiny_spec, 8)
    first = save_adapter(original, tmp_path / "1" / NAMES[src], src)
    assert detect_format(first) == src
    mid = validate(load_adapter(first), tiny_spec, 8)
    second = save_adapter(mid, tmp_path / "2" / NAMES[dst], dst)
    final = validate(load_adapter(second), tiny_spec, 8)
    assert final.dtype == original.dtype
    got, want = _rows(final), _rows(original)
    assert got.keys() == want.keys()
    for key, (rank, a, b) in want.items():
        assert got[key][0] == rank and torch.equal(got[key][1], a) and torch.equal(got[key][2], b)


def test_bf16_npy_is_raw_v2(make_peft, tiny_spec, tmp_path):
    _, folder = make_peft("p", r=2, lora_alpha=2)
    adapter = read_peft(folder, dtype="bfloat16")
    save_adapter(adapter, tmp_path / "n", "npy")
    raw = np.load(tmp_path / "n" / "model.lora_weights.npy")
    assert raw.dtype == np.dtype("V2") and raw.shape == (1, *adapter.weights.shape)
    bits = torch.from_numpy(raw.view(np.int16)[0])
    assert torch.equal(bits, adapter.weights.view(torch.int16))
    assert torch.equal(load_adapter(tmp_path / "n").weights, adapter.weights)


def test_leading_one_is_optional(make_peft, tmp_path):
    _, folder = make_peft("p", r=2, lora_alpha=2)
    adapter = read_peft(folder)
    w, c = adapter.weights, torch.from_numpy(adapter.config)
    (tmp_path / "n").mkdir()
    np.save(tmp_path / "n" / "model.lora_weights.npy", w.numpy())           # [N, W]
    np.save(tmp_path / "n" / "model.lora_config.npy", adapter.config)       # [N, 3]
    save_file({"weights": w, "config": c[None].contiguous()}, str(tmp_path / "s.safetensors"))  # [N,W], [1,N,3]
    for path in (tmp_path / "n", tmp_path / "s.safetensors"):
        assert load_adapter(path).content_hash == adapter.content_hash


@pytest.mark.parametrize("form", ["numpy", "numpy_batched", "torch", "torch_batched", "torch_bf16",
                                  "numpy_v2", "config_int64"])
def test_inline_tensors(tiny_spec, make_peft, form):
    _, folder = make_peft("p", r=2, lora_alpha=2)
    ref = validate(read_peft(folder), tiny_spec, 8)
    w, c = ref.weights, ref.config
    if form == "torch_bf16" or form == "numpy_v2":
        ref = cast_adapter(ref, "bfloat16")
        w = ref.weights
    inputs = {
        "numpy": lambda: (w.numpy(), c),
        "numpy_batched": lambda: (w.numpy()[None], c[None]),
        "torch": lambda: (w, torch.from_numpy(c)),
        "torch_batched": lambda: (w[None], torch.from_numpy(c)[None]),
        "torch_bf16": lambda: (w, c),
        "numpy_v2": lambda: (w.view(torch.int16).numpy().view(np.dtype("V2"))[None], c[None]),
        "config_int64": lambda: (w.numpy(), c.astype(np.int64)),
    }[form]()
    adapter = validate(adapter_from_tensors(*inputs), tiny_spec, 8)
    assert adapter.content_hash == ref.content_hash
    assert adapter.metadata.original_format == "inline"


def test_prefetch_dir_and_adapter_root(make_peft, tiny_spec, tmp_path):
    _, folder = make_peft("p", r=2, lora_alpha=2)
    adapter = read_peft(folder)
    for task in ("0", "7", "12"):
        save_adapter(adapter, tmp_path / "prefetch" / task, "npy")
    save_adapter(adapter, tmp_path / "prefetch" / "notes", "npy")  # not digits: not a task
    assert sorted(list_prefetch_dir(tmp_path / "prefetch")) == [0, 7, 12]
    root = tmp_path / "root"
    save_adapter(adapter, root / "alpha.safetensors", "safetensors")
    save_adapter(adapter, root / "beta", "npy")
    save_adapter(adapter, root / "gamma", "peft")
    (root / "readme.txt").write_text("not an adapter")
    found = list_adapter_root(root)
    assert sorted(found) == ["alpha", "beta", "gamma"]
    assert all(load_adapter(p).content_hash == adapter.content_hash for p in found.values())
