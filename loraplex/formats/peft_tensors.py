"""A PEFT folder's tensors, grouped into (layer, module) factor pairs in the converters' order.

Tensors are visited in the file's key order (sorted names for safetensors),
grouped by layer in first-seen order, then by module in first-seen order, as
the reference converters do. A
`.safetensors` file is mapped, not read (see `mapped`); `.bin` goes only
through `torch.load(weights_only=True)`.
"""
from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.formats.errors import AdapterFormatError, UnsafeFileError, UnsupportedOptionError
from loraplex.formats.mapped import mapped_tensors
from loraplex.formats.modules import HF_TO_MODULE_ID
from loraplex.formats.peft_config import PeftLoraConfig

SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<path>(?:.*\.)?layers\.(?P<layer>\d+)\."
                  r"(?P<block>[^.]+)\.(?P<proj>[^.]+))\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors in file order; `.bin` only through `weights_only=True`."""
    st, bin_ = folder / SAFETENSORS_NAME, folder / BIN_NAME
    if st.is_file():
        return mapped_tensors(st)
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
class Factors:
    """One adapted module's tensors as found in the file."""

    path: str
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None


def group_factors(sd: dict[str, torch.Tensor], cfg: PeftLoraConfig) -> dict[tuple[int, str], Factors]:
    """(layer, proj) -> factors, in the converters' order (layer first-seen, then module)."""
    by_layer: dict[int, dict[str, Factors]] = {}
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
        entry = by_layer.setdefault(layer, {}).setdefault(proj, Factors(path))
        if m["ab"] == "A":
            entry.a = t
        else:
            entry.b = t
    return {(layer, proj): e for layer, mods in by_layer.items() for proj, e in mods.items()}
