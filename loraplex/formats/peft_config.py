"""PEFT `adapter_config.json`: the options loraplex honours and the ones it refuses.

Honoured: `r`, `lora_alpha`, `use_rslora`, `rank_pattern`, `alpha_pattern`
(matched the way PEFT matches them), `target_modules` (list or regex),
`layers_to_transform`, `fan_in_fan_out` (PEFT stores A `[r, in]` and B
`[out, r]` either way; the flag only transposes the merged delta of Conv1D
layers, so the rows are the same). Refused, with the option named:
`use_dora`, `modules_to_save`, `bias` other than `none`, `lora_bias`,
`layer_replication`, `trainable_token_indices`, `target_parameters`,
`alora_invocation_tokens`, `megatron_config`, `use_qalora`, `use_bdlora`,
`kasa_config`, `monteclora_config`, `arrow_config`, and targets that
are embeddings, `lm_head` or names outside the module table.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.formats.errors import AdapterFormatError, UnsupportedOptionError
from loraplex.formats.modules import HF_TO_MODULE_ID

# option -> why loraplex refuses it when set (truthy, or `bias` != "none")
_REFUSED: dict[str, str] = {
    "use_dora": "DoRA's magnitude vector changes the base weight, not a low-rank delta",
    "modules_to_save": "it replaces whole base modules (e.g. lm_head), which a shared base model cannot",
    "lora_bias": "a bias on lora_B is not part of the A/B row format",
    "layer_replication": "it changes the base model's layer stack",
    "trainable_token_indices": "it edits embedding rows of the shared base model",
    "target_parameters": "LoRA on raw parameters (MoE experts) has no module id",
    "alora_invocation_tokens": "activated LoRA needs per-token activation loraplex does not do",
    "megatron_config": "Megatron-sharded LoRA layers are not supported",
    "use_qalora": "QA-LoRA pools inputs, which the row format cannot express",
    "use_bdlora": "block-diagonal factors are stored in a layout the row format does not have",
    "kasa_config": "KaSA rewrites the base weight and adds a singular-value diagonal",
    "monteclora_config": "Monte Carlo sampling on top of the factors is not a fixed low-rank delta",
    "arrow_config": "Arrow routes between several LoRAs per token",
}
_NON_LINEAR_TARGETS = ("embed_tokens", "wte", "lm_head", "embed_out", "word_embeddings")


@dataclass(frozen=True)
class PeftLoraConfig:
    """The parts of a PEFT LoRA config that decide each converted row."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_modules: list[str] | str | None = None
    layers_to_transform: list[int] | None = None
    fan_in_fan_out: bool = False
    base_model_name_or_path: str = ""

    def rank_for(self, module_path: str) -> int:
        """The rank PEFT gives `module_path` (e.g. 'model.layers.0.self_attn.q_proj')."""
        key = _pattern_key(self.rank_pattern, module_path)
        return int(self.rank_pattern[key]) if key is not None else self.r

    def alpha_for(self, module_path: str) -> float:
        key = _pattern_key(self.alpha_pattern, module_path)
        return float(self.alpha_pattern[key]) if key is not None else self.lora_alpha

    def scale_for(self, module_path: str) -> float:
        """PEFT's `scaling`: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        r = self.rank_for(module_path)
        alpha = self.alpha_for(module_path)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module_path: str) -> bool:
        """Whether `target_modules` selects `module_path` (PEFT's matching rules)."""
        t = self.target_modules
        if t is None or t == "all-linear":
            return True
        if isinstance(t, str):
            return re.fullmatch(t, module_path) is not None
        return any(module_path == k or module_path.endswith("." + k) for k in t)


def _pattern_key(patterns: dict[str, Any], module_path: str) -> str | None:
    # PEFT's get_pattern_key: first pattern whose regex ends the module path
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_path):
            return key
    return None


def _check_targets(target_modules: Any) -> list[str] | str | None:
    if target_modules is None or isinstance(target_modules, str):
        if isinstance(target_modules, str) and any(n in target_modules for n in _NON_LINEAR_TARGETS):
            raise UnsupportedOptionError("target_modules", f"{target_modules!r} targets an "
                                         "embedding or lm_head, which loraplex does not adapt")
        return target_modules
    if not isinstance(target_modules, (list, tuple)):
        raise AdapterFormatError(f"target_modules must be a list of names or a regex string, "
                                 f"got {type(target_modules).__name__}")
    names = [str(t) for t in target_modules]
    for name in names:
        short = name.rsplit(".", 1)[-1]
        if short in _NON_LINEAR_TARGETS:
            raise UnsupportedOptionError("target_modules", f"{name!r} is an embedding or lm_head; "
                                         "loraplex adapts only the decoder's linear layers")
        if short not in HF_TO_MODULE_ID:
            raise UnsupportedOptionError("target_modules", f"unknown module {name!r}; known: "
                                         f"{sorted(HF_TO_MODULE_ID)}")
    return names


def parse_peft_config(raw: dict[str, Any]) -> PeftLoraConfig:
    """Checks a PEFT config dict and keeps what the conversion needs."""
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise UnsupportedOptionError("peft_type", f"{peft_type} adapters are not LoRA")
    for option, why in _REFUSED.items():
        if raw.get(option):
            raise UnsupportedOptionError(option, why)
    if str(raw.get("bias") or "none") != "none":
        raise UnsupportedOptionError("bias", f"bias={raw['bias']!r} trains base-model biases; "
                                     "only 'none' can be served")
    if "r" not in raw or "lora_alpha" not in raw:
        raise AdapterFormatError("adapter_config.json lacks 'r' or 'lora_alpha'")
    targets = _check_targets(raw.get("target_modules"))
    layers = raw.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    try:
        return PeftLoraConfig(
            r=int(raw["r"]), lora_alpha=float(raw["lora_alpha"]),
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern={str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
            alpha_pattern={str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
            target_modules=targets,
            layers_to_transform=[int(x) for x in layers] if layers else None,
            fan_in_fan_out=bool(raw.get("fan_in_fan_out", False)),
            base_model_name_or_path=str(raw.get("base_model_name_or_path") or ""),
        )
    except (TypeError, ValueError) as e:
        raise AdapterFormatError(f"adapter_config.json has a malformed value ({e})") from e


def read_peft_config(folder: Path) -> PeftLoraConfig:
    path = folder / "adapter_config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterFormatError(f"{folder}: no adapter_config.json (not a PEFT folder)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterFormatError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{path}: expected a JSON object")
    return parse_peft_config(raw)
