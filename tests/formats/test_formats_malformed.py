"""A corpus of malformed adapters: each is refused with its own specific error."""
from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from formats_helpers import SEED_SPEC, seed_tensors, write_peft_folder
from loraplex.formats import (AdapterFormatError, AdapterTooLargeError, AdapterValidationError,
                              BaseModelMismatchError, DtypeError, DuplicateRowError,
                              EmptyAdapterError, LayerOutOfRangeError, ModelSpec,
                              ModuleNotEnabledError, NonFiniteError, PaddingError, RankError,
                              RowShapeError, UnknownModuleError, UnsafeFileError,
                              UnsupportedOptionError, adapter_from_tensors, load_adapter,
                              save_adapter, validate)

MAX_RANK = 8


def _seed() -> tuple[np.ndarray, torch.Tensor]:
    config, weights, _ = seed_tensors(torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()))))
    return config, weights


def _inline(edit: Callable[[np.ndarray, torch.Tensor], tuple]) -> Callable[[Path], object]:
    """A case that edits the seed tensors, then reads and validates them inline."""
    def run(_: Path):
        config, weights = _seed()
        config, weights = edit(config.copy(), weights.clone())
        return validate(adapter_from_tensors(weights, config), SEED_SPEC, MAX_RANK)
    return run


def _set(arr, idx, value):
    arr[idx] = value
    return arr


def _saved(fmt: str, damage: Callable[[Path], None]) -> Callable[[Path], object]:
    """A case that writes the seed adapter as `fmt`, damages the files, then loads them."""
    def run(tmp: Path):
        config, weights = _seed()
        path = save_adapter(validate(adapter_from_tensors(weights, config), SEED_SPEC, MAX_RANK),
                            tmp / ("a.safetensors" if fmt == "safetensors" else "a"), fmt)
        damage(path)
        return validate(load_adapter(path), SEED_SPEC, MAX_RANK)
    return run


def _truncate(name: str | None) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        f = path / name if name else path
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    return damage


def _peft(config: dict, tensors: dict | None = None) -> Callable[[Path], object]:
    def run(tmp: Path):
        gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
        base = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, 4, generator=gen),
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(4, 2, generator=gen)}
        return load_adapter(write_peft_folder(tmp / "p", config, {**base, **(tensors or {})}))
    return run


class _Payload:
    def __reduce__(self):
        return (print, ("a pickle payload ran",))


def _pickle_bin(tmp: Path):
    folder = tmp / "p"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    torch.save({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": _Payload()},
               folder / "adapter_model.bin")
    return load_adapter(folder)


def _npy_object_array(tmp: Path):
    (tmp / "a").mkdir()
    np.save(tmp / "a" / "model.lora_weights.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    np.save(tmp / "a" / "model.lora_config.npy", np.zeros((1, 3), np.int32))
    return load_adapter(tmp / "a")


def _safetensors_without_names(tmp: Path):
    save_file({"lora": torch.randn(2, 3)}, str(tmp / "x.safetensors"))
    return load_adapter(tmp / "x.safetensors")


def _overflow_fp16(_: Path):
    config, weights = _seed()
    weights[2, 3] = 1e6
    return validate(adapter_from_tensors(weights, config), SEED_SPEC, MAX_RANK, dtype="float16")


def _too_large(_: Path):
    config, weights = _seed()
    return validate(adapter_from_tensors(weights, config), SEED_SPEC, MAX_RANK, max_bytes=1000)


def _other_model(_: Path):
    config, weights = _seed()
    adapter = validate(adapter_from_tensors(weights, config), SEED_SPEC, MAX_RANK)
    other = ModelSpec(num_layers=4, hidden_size=4, num_attention_heads=2, num_key_value_heads=2,
                      head_dim=2, intermediate_size=8)
    return validate(adapter, other, MAX_RANK)


Q = "base_model.model.model.layers.0.self_attn.q_proj"
CASES: dict[str, tuple[Callable[[Path], object], type[Exception], str]] = {
    "truncated npy": (_saved("npy", _truncate("model.lora_weights.npy")), AdapterFormatError, "lora_weights"),
    "truncated safetensors": (_saved("safetensors", _truncate(None)), AdapterFormatError, "safetensors"),
    "truncated PEFT safetensors": (_saved("peft", _truncate("adapter_model.safetensors")), AdapterFormatError,
                                   "adapter_model.safetensors"),
    "weights 1-D": (_inline(lambda c, w: (c, w.flatten())), AdapterFormatError, "[N, W]"),
    "config 4 columns": (_inline(lambda c, w: (np.concatenate([c, c[:, :1]], 1), w)), AdapterFormatError, "3 columns"),
    "config float": (_inline(lambda c, w: (c.astype(np.float32), w)), AdapterFormatError, "integer"),
    "config/weights lengths differ": (_inline(lambda c, w: (c[:5], w)), AdapterFormatError, "6"),
    "weights int32": (_inline(lambda c, w: (c, w.to(torch.int32))), DtypeError, "int32"),
    "module id 42": (_inline(lambda c, w: (_set(c, (3, 0), 42), w)), UnknownModuleError, "row 3"),
    "module not enabled": (_inline(lambda c, w: (_set(c, (1, 0), 9), w)), ModuleNotEnabledError, "row 1"),
    "layer out of range": (_inline(lambda c, w: (_set(c, (4, 1), 4), w)), LayerOutOfRangeError, "row 4"),
    "negative layer": (_inline(lambda c, w: (_set(c, (0, 1), -1), w)), LayerOutOfRangeError, "row 0"),
    "rank 0": (_inline(lambda c, w: (_set(c, (2, 2), 0), w)), RankError, "row 2"),
    "rank > max": (_inline(lambda c, w: (_set(c, (5, 2), 9), w)), RankError, "row 5"),
    "NaN": (_inline(lambda c, w: (c, _set(w, (3, 7), float("nan")))), NonFiniteError, "row 3"),
    "Inf": (_inline(lambda c, w: (c, _set(w, (1, 0), float("inf")))), NonFiniteError, "row 1"),
    "duplicate row": (_inline(lambda c, w: (_set(c, 3, c[1]), w)), DuplicateRowError, "row 3"),
    "non-zero padding": (_inline(lambda c, w: (c, _set(w, (0, 40), 0.5))), PaddingError, "row 0"),
    "row too short": (_inline(lambda c, w: (c, w[:, :48])), RowShapeError, "row 5"),
    "no rows": (_inline(lambda c, w: (c[:0], w[:0])), EmptyAdapterError, "no rows"),
    "overflows float16": (_overflow_fp16, NonFiniteError, "row 2"),
    "over the size limit": (_too_large, AdapterTooLargeError, "1000"),
    "other base model": (_other_model, BaseModelMismatchError, "base model"),
    ".bin pickle payload": (_pickle_bin, UnsafeFileError, "weights_only"),
    "npy object array": (_npy_object_array, AdapterFormatError, "npy"),
    "safetensors without weights/config": (_safetensors_without_names, AdapterFormatError, "'weights'"),
    "use_dora": (_peft({"use_dora": True}), UnsupportedOptionError, "use_dora"),
    "modules_to_save": (_peft({"modules_to_save": ["lm_head"]}), UnsupportedOptionError, "modules_to_save"),
    "bias all": (_peft({"bias": "all"}), UnsupportedOptionError, "bias"),
    "embedding target": (_peft({"target_modules": ["q_proj", "embed_tokens"]}), UnsupportedOptionError,
                         "target_modules"),
    "lm_head tensor": (_peft({}, {"base_model.model.lm_head.lora_A.weight": torch.ones(2, 4)}),
                       UnsupportedOptionError, "target_modules"),
    "unknown module": (_peft({"target_modules": None}, {"base_model.model.model.layers.0.self_attn.c_attn.lora_A.weight":
                                                       torch.ones(2, 4)}), UnsupportedOptionError, "c_attn"),
    "DoRA magnitude tensor": (_peft({}, {f"{Q}.lora_magnitude_vector": torch.ones(4)}),
                              UnsupportedOptionError, "use_dora"),
    "not LoRA": (_peft({"peft_type": "IA3"}), UnsupportedOptionError, "peft_type"),
    "rank differs from r": (_peft({"r": 4}), AdapterFormatError, "rank 2"),
    "lora_B missing": (_peft({"target_modules": ["q_proj", "v_proj"]}, {f"{Q.replace('q_proj', 'v_proj')}.lora_A.weight": torch.ones(2, 4)}),
                       AdapterFormatError, "lora_B is missing"),
    "outside layers_to_transform": (_peft({"layers_to_transform": [1]}), AdapterFormatError, "layers_to_transform"),
    "target_modules not a list": (_peft({"target_modules": 7}), AdapterFormatError, "target_modules"),
    "bad json": (lambda tmp: load_adapter(_bad_json(tmp)), AdapterFormatError, "JSON"),
}


def _bad_json(tmp: Path) -> Path:
    (tmp / "p").mkdir()
    (tmp / "p" / "adapter_config.json").write_text('{"r": 2, "lora_alpha": ')
    return tmp / "p"


def test_corpus_is_large_enough():
    assert len(CASES) >= 20


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_input_gets_its_error(name, tmp_path, capsys):
    case, error, fragment = CASES[name]
    with pytest.raises(error) as info:
        case(tmp_path)
    assert fragment in str(info.value), str(info.value)
    if isinstance(info.value, AdapterValidationError) and fragment.startswith("row "):
        assert info.value.row == int(fragment.split()[1])
    if isinstance(info.value, UnsupportedOptionError) and name not in ("unknown module", "lm_head tensor"):
        assert info.value.option in fragment or fragment in info.value.option
    assert "a pickle payload ran" not in capsys.readouterr().out


def test_a_rank_above_the_servers_largest_names_the_flag_that_raises_it(tmp_path):
    case, error, _ = CASES["rank > max"]
    with pytest.raises(error) as info:
        case(tmp_path)
    assert "--max-lora-rank" in str(info.value) and "rank 9" in str(info.value), str(info.value)
