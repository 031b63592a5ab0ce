"""`loraplex quantize`: a dense checkpoint (HF safetensors folder or GGUF) -> a quantized HF folder.

Round-to-nearest (`quantize_rtn`) of every projection (q, k, v, o, gate, up, down) into the AWQ GEMM,
the compressed-tensors pack-quantized or the GPTQ layout, with the matching `quantization_config`, so
this engine and others read it back. Embeddings, norms and the LM head stay as they were; a projection
whose in features the group size does not divide stays dense and is listed as not converted.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compute_service.engine.errors import ModelLoadError
from compute_service.engine.quant_formats import awq, compressed_tensors, gptq
from compute_service.engine.quantized import quantize_rtn
from compute_service.engine.spec import ModelSpec

FORMATS = ("compressed-tensors", "awq", "gptq")
# Each projection's fused group (`LAYER_PROJECTIONS`): the projections of one read the same input, so an
# act-order checkpoint orders their channels alike.
INPUT_GROUPS = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv",
                "self_attn.o_proj": "o", "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up",
                "mlp.down_proj": "down"}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass
class QuantizeResult:
    out: Path
    num_quantized: int = 0
    not_converted: list[str] = field(default_factory=list)
    quantized_bytes: int = 0
    dense_bytes: int = 0
    tokenizer: str = ""               # what happened to the tokenizer files


def quantize_checkpoint(src: Path, out: Path, *, bits: int = 4, group_size: int = 128,
                        fmt: str = "compressed-tensors", symmetric: bool = False,
                        progress: bool = True, device: str | torch.device = "cpu",
                        act_order_seed: int | None = None) -> QuantizeResult:
    """Writes `out` (a new or empty folder): config.json, model.safetensors, the tokenizer files.
    `device`: where each projection is rounded and packed (a GPU makes an 8B model in seconds rather than
    minutes; the result is the same), one projection at a time.
    `act_order_seed` (GPTQ only): the layout of an act-order (desc_act) checkpoint, each group holding channels
    of a random order drawn from this seed, one order per input of a layer. GPTQ takes that order from
    calibration data and it then helps accuracy; a random one does not: it is for benchmarks and tests of
    the layout, not offered by the command."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from compute_service.engine.loader import read_model_source

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "awq":
        awq.quantization_config(bits, group_size, [])        # refuses what AWQ cannot hold, before any work
    if act_order_seed is not None and fmt != "gptq":
        raise ValueError(f"an act-order layout is a GPTQ one, not {fmt}")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: give a new folder")
    spec, get, _ = read_model_source(src)
    result = QuantizeResult(out)
    tensors: dict[str, torch.Tensor] = {}
    for name in _dense_names(spec):
        t = get(name)
        if t is None:
            raise ModelLoadError(f"{src} lacks tensor {name!r}")
        tensors[name] = t.contiguous()
        result.dense_bytes += t.nbytes
    prefixes = [f"model.layers.{i}.{p}" for i in range(spec.num_layers) for p in PROJECTIONS]
    for prefix in tqdm(prefixes, desc=f"quantize {bits}-bit {fmt}", unit="proj", disable=not progress):
        w = get(prefix + ".weight")
        if w is None:
            raise ModelLoadError(f"{src} lacks tensor {prefix + '.weight'!r}")
        if w.shape[1] % group_size:
            tensors[prefix + ".weight"] = w.contiguous()
            result.not_converted.append(prefix)
            result.dense_bytes += w.nbytes
            continue
        order = None if act_order_seed is None else _channel_order(prefix, w.shape[1], act_order_seed)
        w = w.to(device)
        qw = quantize_rtn(w if order is None else w[:, order.to(w.device)], bits, group_size, symmetric=symmetric)
        part = (awq.tensors(prefix, qw) if fmt == "awq" else gptq.tensors(prefix, qw, order) if fmt == "gptq"
                else compressed_tensors.tensors(prefix, qw, symmetric))
        part = {name: t.cpu() for name, t in part.items()}
        tensors.update(part)
        result.num_quantized += 1
        result.quantized_bytes += sum(t.nbytes for t in part.values())
    out.mkdir(parents=True, exist_ok=True)
    ignore = [p for p in result.not_converted]
    qcfg = (awq.quantization_config(bits, group_size, ignore) if fmt == "awq"
            else gptq.quantization_config(bits, group_size, symmetric, act_order_seed is not None, ignore)
            if fmt == "gptq"
            else compressed_tensors.quantization_config(bits, group_size, symmetric, ignore + ["lm_head"]))
    config = _hf_config(src, spec)
    config["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    result.tokenizer = _copy_tokenizer(src, out)
    return result


def _channel_order(prefix: str, k: int, seed: int) -> torch.Tensor:
    """A random order of a projection's K input channels, the same for the projections of one input."""
    from compute_service.engine.model import LAYER_PROJECTIONS

    layer, proj = prefix.removeprefix("model.layers.").split(".", 1)
    group = LAYER_PROJECTIONS.index(INPUT_GROUPS[proj])
    seed = seed * 1_000_003 + int(layer) * len(LAYER_PROJECTIONS) + group
    return torch.randperm(k, generator=torch.Generator().manual_seed(seed))


def _dense_names(spec: ModelSpec) -> list[str]:
    """Every tensor the engine reads other than the projections' weights."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if spec.qkv_bias:
            names += [p + f"self_attn.{m}_proj.bias" for m in "qkv"]
        if spec.o_bias:
            names.append(p + "self_attn.o_proj.bias")
        if spec.mlp_bias:
            names += [p + f"mlp.{m}_proj.bias" for m in ("gate", "up", "down")]
    return names


def _hf_config(src: Path, spec: ModelSpec) -> dict[str, Any]:
    """The source folder's config.json (less any quantization_config), or one made from a GGUF's spec."""
    if src.is_dir():
        cfg: dict[str, Any] = json.loads((src / "config.json").read_text())
        cfg.pop("quantization_config", None)
        return cfg
    cfg = {"architectures": [_ARCHITECTURES[spec.architecture]], "model_type": spec.architecture,
           "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
           "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
           "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
           "max_position_embeddings": spec.max_position_embeddings, "rms_norm_eps": spec.rms_norm_eps,
           "rope_theta": spec.rope_theta, "tie_word_embeddings": spec.tie_word_embeddings, "hidden_act": "silu",
           "mlp_bias": spec.mlp_bias, "torch_dtype": "float32",
           "eos_token_id": list(spec.eos_token_ids) if len(spec.eos_token_ids) > 1 else spec.eos_token_id,
           "bos_token_id": spec.bos_token_id}
    if spec.architecture != "qwen2":
        cfg["attention_bias"] = spec.o_bias
    if spec.rope_scaling is not None:
        r = spec.rope_scaling
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                               "high_freq_factor": r.high_freq_factor,
                               "original_max_position_embeddings": r.original_max_position_embeddings}
    return cfg


def _copy_tokenizer(src: Path, out: Path) -> str:
    if src.is_dir():
        copied = [name for name in _TOKENIZER_FILES if (src / name).is_file()]
        for name in copied:
            shutil.copy2(src / name, out / name)
        return f"copied {', '.join(copied)}" if copied else "none in the source folder"
    from compute_service.engine.loader import load_tokenizer

    try:
        load_tokenizer(src).save_pretrained(str(out))
    except (OSError, ValueError, KeyError, TypeError) as exc:     # a GGUF without a usable vocabulary
        return f"not written ({type(exc).__name__}: {exc})"
    return "written from the GGUF's vocabulary"
