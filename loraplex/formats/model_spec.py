"""`ModelSpec`: the base-model shapes an adapter is validated against.

Built from a Hugging Face `config.json` (a dict, the file, or its folder), a
transformers config or model, or a GGUF file's metadata (read with the `gguf`
package; tensors are not loaded).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loraplex.formats.errors import AdapterFormatError
from loraplex.formats.modules import ModuleShape, module_shape


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a Llama-family decoder that decide every LoRA row's size."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int = 0
    model_type: str = "llama"

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ModelSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")

    def module_shape(self, module_id: int) -> ModuleShape:
        """In/out features of module `module_id` (KeyError for modules without a shape)."""
        return module_shape(module_id, hidden_size=self.hidden_size,
                            num_attention_heads=self.num_attention_heads,
                            num_key_value_heads=self.num_key_value_heads,
                            head_dim=self.head_dim, intermediate_size=self.intermediate_size)

    @property
    def fingerprint(self) -> str:
        """Hash of the shapes: adapters validated for one spec fit every model with it."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "ModelSpec":
        """From a Hugging Face `config.json` dict (Llama, Mistral, Qwen2, SmolLM ...)."""
        cfg = dict(config.get("text_config") or config)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            return cls(
                num_layers=int(cfg["num_hidden_layers"]),
                hidden_size=hidden,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg.get("vocab_size") or 0),
                model_type=str(cfg.get("model_type", "llama")),
            )
        except KeyError as e:
            raise AdapterFormatError(f"model config lacks {e.args[0]!r}; need a Llama-family "
                                     "config.json (hidden_size, num_hidden_layers, ...)") from None

    @classmethod
    def from_model(cls, model_or_config: Any) -> "ModelSpec":
        """From a transformers model or `PretrainedConfig`."""
        cfg = getattr(model_or_config, "config", model_or_config)
        return cls.from_hf_config(cfg.to_dict())

    @classmethod
    def from_gguf(cls, path: str | Path) -> "ModelSpec":
        """From a GGUF file's metadata (`<arch>.block_count`, `<arch>.embedding_length`, ...), read without
        building the vocabulary's strings (`gguf_header`: 0.1 s where a general reader takes seconds)."""
        from loraplex.formats.gguf_header import read_header

        try:
            header = read_header(Path(path))
        except Exception as e:  # bad magic/version (ValueError), truncated (struct.error), unreadable (OSError)
            raise AdapterFormatError(f"{path}: not a readable GGUF file ({e})") from e
        fields = header.fields

        arch = fields.get("general.architecture", "llama")
        hidden = fields.get(f"{arch}.embedding_length")
        heads = fields.get(f"{arch}.attention.head_count")
        layers = fields.get(f"{arch}.block_count")
        inter = fields.get(f"{arch}.feed_forward_length")
        if None in (hidden, heads, layers, inter):
            raise AdapterFormatError(f"{path}: GGUF metadata lacks the {arch} shapes")
        kv = fields.get(f"{arch}.attention.head_count_kv", heads)
        head_dim = fields.get(f"{arch}.attention.key_length", int(hidden) // int(heads))
        vocab = fields.get(f"{arch}.vocab_size")
        if vocab is None:
            tokens = fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens) if tokens is not None else header.array_lengths.get("tokenizer.ggml.tokens", 0)
        return cls(num_layers=int(layers), hidden_size=int(hidden), num_attention_heads=int(heads),
                   num_key_value_heads=int(kv), head_dim=int(head_dim),
                   intermediate_size=int(inter), vocab_size=int(vocab), model_type=str(arch))

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelSpec":
        """From a `config.json`, a folder holding one, or a `.gguf` file."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if p.suffix == ".gguf":
            return cls.from_gguf(p)
        try:
            config = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise AdapterFormatError(f"{p}: cannot read a model config.json ({e})") from e
        return cls.from_hf_config(config)
