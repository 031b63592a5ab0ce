"""ModelSpec: the shape of a Llama-family decoder, read from a HF config or GGUF metadata."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from compute_service.engine.errors import ModelLoadError, UnsupportedModelError

# HF architecture name -> our family tag. Mistral is Llama-shaped; its sliding
# window is not applied (it only matters past 4096 tokens for the 7B).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type "llama3"); None fields mean plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about the base model's shape."""

    architecture: str            # "llama" | "mistral" | "qwen2"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: RopeScaling | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "") -> "ModelSpec":
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            raise UnsupportedModelError(
                f"architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope_theta, scaling = _rope_from_hf(cfg)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                architecture=family,
                num_layers=int(cfg["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family != "qwen2")),
                qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
                o_bias=family != "qwen2" and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                rope_scaling=scaling,
                eos_token_ids=eos_ids,
                bos_token_id=_first_int(cfg.get("bos_token_id")),
                name=name,
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None


def _first_int(v: Any) -> int | None:
    if isinstance(v, list):
        return int(v[0]) if v else None
    return None if v is None else int(v)


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """transformers 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported (supported: default, llama3)")
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2"}


def spec_from_gguf_fields(fields: dict[str, Any], num_vocab_tokens: int, has_output: bool, name: str,
                          rope_freqs: Sequence[float] | None = None) -> ModelSpec:
    """Builds a ModelSpec from GGUF metadata (keys like `llama.block_count`) and the file's `rope_freqs`
    tensor if it has one (per-frequency divisors of the angles: Llama 3.1 and later), read back with any
    linear scaling as the Llama-3 scaling that gives the same angles (`rope.llama3_scaling_from_divisors`)."""
    from compute_service.engine.rope import llama3_scaling_from_divisors

    arch = fields.get("general.architecture")
    if arch not in _GGUF_ARCH:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_GGUF_ARCH)}")
    try:
        heads = int(fields[f"{arch}.attention.head_count"])
        hidden = int(fields[f"{arch}.embedding_length"])
        head_dim = int(fields.get(f"{arch}.attention.key_length", hidden // heads))
        theta = float(fields.get(f"{arch}.rope.freq_base", 10000.0))
        kind = fields.get(f"{arch}.rope.scaling.type", "none")
        if kind not in ("none", "linear"):
            raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported (none, linear and Llama-3 "
                                        "rope_freqs are)")
        linear = float(fields.get(f"{arch}.rope.scaling.factor", 1.0)) if kind == "linear" else 1.0
        divisors = [linear * f for f in (rope_freqs if rope_freqs is not None else [1.0] * (head_dim // 2))]
        scaling = llama3_scaling_from_divisors(divisors, head_dim, theta)
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return ModelSpec(
            architecture=_GGUF_ARCH[arch],
            num_layers=int(fields[f"{arch}.block_count"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            intermediate_size=int(fields[f"{arch}.feed_forward_length"]),
            vocab_size=int(fields.get(f"{arch}.vocab_size", num_vocab_tokens)),
            rms_norm_eps=float(fields[f"{arch}.attention.layer_norm_rms_epsilon"]),
            rope_theta=theta,
            max_position_embeddings=int(fields.get(f"{arch}.context_length", 4096)),
            tie_word_embeddings=not has_output,
            qkv_bias=arch == "qwen2",
            rope_scaling=scaling,
            eos_token_ids=() if eos is None else (int(eos),),
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            name=name,
        )
    except KeyError as e:
        raise ModelLoadError(f"GGUF metadata lacks required key {e.args[0]!r}") from None
