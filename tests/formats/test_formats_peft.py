"""PEFT adapters made with `peft` convert exactly: rows equal PEFT's own deltas, round trips are exact."""
from __future__ import annotations

import json

import pytest
import torch

from loraplex.formats import (HF_TO_MODULE_ID, MODULE_ID_TO_HF, load_adapter, read_peft,
                              validate, write_peft)

VARIANTS = {
    "plain": dict(r=4, lora_alpha=8),
    "rank_alpha_pattern": dict(r=4, lora_alpha=8, rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 6},
                               alpha_pattern={"v_proj": 3, "layers.2.self_attn.o_proj": 16}),
    "rslora": dict(r=8, lora_alpha=4, use_rslora=True),
    "layers_to_transform": dict(r=4, lora_alpha=16, layers_to_transform=[0, 2]),
    "regex_targets": dict(r=3, lora_alpha=5, target_modules=r".*\.(q_proj|v_proj|up_proj)"),
}


def _module(peft_model, layer: int, module_id: int):
    name = MODULE_ID_TO_HF[module_id]
    block = peft_model.base_model.model.model.layers[layer]
    return getattr(block.self_attn if module_id <= 4 else block.mlp, name)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rows_equal_peft_delta_weight(make_peft, tiny_spec, variant):
    model, folder = make_peft(variant, **VARIANTS[variant])
    adapter = validate(load_adapter(folder), tiny_spec, max_lora_rank=16)
    seen = set()
    for row in adapter.rows():
        module = _module(model, row.layer_idx, row.module_id)
        assert module.lora_A["default"].weight.shape[0] == row.rank
        expected = module.get_delta_weight("default")
        assert expected.abs().max() > 0  # random B, so a wrong scale cannot hide
        torch.testing.assert_close(row.b @ row.a, expected, rtol=1e-5, atol=1e-6)
        seen.add((row.module_id, row.layer_idx))
    # every adapted module became exactly one row
    expected_rows = {(HF_TO_MODULE_ID[n.rsplit(".", 1)[-1]], int(n.split("layers.")[1].split(".")[0]))
                     for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert seen == expected_rows


def test_rank_pattern_and_layers_land_in_config(make_peft):
    _, folder = make_peft("rp", r=4, lora_alpha=8, rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 6},
                          layers_to_transform=[1, 2])
    adapter = read_peft(folder)
    by_key = {(m, l): r for m, l, r in adapter.config.tolist()}
    assert by_key[(1, 1)] == 2 and by_key[(1, 2)] == 2        # q_proj everywhere rank 2
    assert by_key[(6, 1)] == 6 and by_key[(6, 2)] == 4        # one down_proj at rank 6
    assert {l for _, l in by_key} == {1, 2}                   # layer 0 untouched
    assert by_key[(5, 1)] == 4 and by_key[(7, 1)] == 4        # gate -> 5, up -> 7 (converters' ids)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_peft_round_trip_is_exact(make_peft, tiny_spec, tmp_path, variant):
    _, folder = make_peft(variant, **VARIANTS[variant])
    first = read_peft(folder)
    write_peft(first, tmp_path / "back")
    second = read_peft(tmp_path / "back")
    assert torch.equal(first.weights, second.weights)
    assert (first.config == second.config).all()
    assert first.content_hash == second.content_hash
    written = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert written["bias"] == "none" and not written["use_rslora"]


def test_written_peft_loads_in_peft_with_same_deltas(make_peft, tiny_llama, tmp_path):
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    model, folder = make_peft("orig", **VARIANTS["rank_alpha_pattern"])
    write_peft(read_peft(folder), tmp_path / "back")
    base = LlamaForCausalLM(LlamaConfig(**model.base_model.model.config.to_dict()))
    reloaded = PeftModel.from_pretrained(base, tmp_path / "back")
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            other = reloaded.get_submodule(name)
            torch.testing.assert_close(other.get_delta_weight("default"), module.get_delta_weight("default"),
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_storage_dtype_is_the_cast_of_fp32_rows(make_peft, dtype):
    _, folder = make_peft("d", r=4, lora_alpha=8)
    fp32 = read_peft(folder)
    low = read_peft(folder, dtype=dtype)
    assert str(low.dtype) == f"torch.{dtype}"
    assert torch.equal(low.weights, fp32.weights.to(low.dtype))


def test_half_precision_peft_keeps_its_dtype(make_peft, tiny_spec):
    model, folder = make_peft("h", dtype=torch.bfloat16, r=4, lora_alpha=8)
    adapter = validate(read_peft(folder), tiny_spec, 8)
    assert adapter.dtype == torch.bfloat16
    row = next(adapter.rows())
    expected = _module(model, row.layer_idx, row.module_id).get_delta_weight("default")
    torch.testing.assert_close(row.b.float() @ row.a.float(), expected.float(), rtol=2e-2, atol=2e-3)


def test_rows_follow_the_converters_order(make_peft):
    """Sorted tensor names, grouped by layer then module in first-seen order (like hf_lora_convert.py)."""
    _, folder = make_peft("o", r=2, lora_alpha=2)
    ids = [MODULE_ID_TO_HF[m] for m, layer, _ in read_peft(folder).config.tolist() if layer == 0]
    assert ids == ["down_proj", "gate_proj", "up_proj", "k_proj", "o_proj", "q_proj", "v_proj"]
    layers = [layer for _, layer, _ in read_peft(folder).config.tolist()]
    assert layers == sorted(layers)


def test_gate_up_proj_is_module_5_with_b_halves_swapped(tmp_path):
    from formats_helpers import write_peft_folder

    a, b = torch.randn(2, 6), torch.randn(10, 2)  # fused gate_up: out = 2 x 5
    key = "base_model.model.model.layers.1.mlp.gate_up_proj"
    folder = write_peft_folder(tmp_path / "p", {"target_modules": ["gate_up_proj"], "lora_alpha": 6},
                               {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b})
    adapter = read_peft(folder)
    assert adapter.config.tolist() == [[5, 1, 2]]
    row = next(adapter.rows())
    assert torch.equal(row.a, a)
    torch.testing.assert_close(row.b, torch.cat([b[5:], b[:5]]) * 3.0)


def test_fan_in_fan_out_does_not_change_rows(tmp_path):
    from formats_helpers import write_peft_folder

    a, b = torch.randn(2, 4), torch.randn(4, 2)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}
    plain = read_peft(write_peft_folder(tmp_path / "a", {}, tensors))
    fifo = read_peft(write_peft_folder(tmp_path / "b", {"fan_in_fan_out": True}, tensors))
    assert torch.equal(plain.weights, fifo.weights)
    assert fifo.metadata.extra["fan_in_fan_out"] == "True"


def test_bin_weights_read_like_safetensors(make_peft, tmp_path):
    from safetensors.torch import load_file

    _, folder = make_peft("s", r=4, lora_alpha=8)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    torch.save(dict(sorted(tensors.items())), bin_dir / "adapter_model.bin")
    assert read_peft(bin_dir).content_hash == read_peft(folder).content_hash
