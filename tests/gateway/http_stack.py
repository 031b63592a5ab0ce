"""The HTTP API's test stack: `loraplex serve` (cache, compute on the CPU, gateway) over a tiny model.

The model is a random two-layer Llama with SmolLM2's tokenizer (so prompts,
chat template and detokenizing are real) and SmolLM2's vocabulary; it starts
in seconds and its greedy output is deterministic. Adapters are PEFT folders
for it, under the cache's adapter root.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from loraplex.procs import ServiceProcess, start_service
from loraplex.v1 import compute_pb2, compute_pb2_grpc

DIMS = dict(hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)


def make_tiny_model(folder: Path, tokenizer) -> Path:
    """A random Llama (SmolLM2's vocabulary and tokenizer, tied embeddings) saved as a HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    cfg = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, rms_norm_eps=1e-5,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **DIMS)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():       # wider than the default init, so outputs vary and adapters matter
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def write_adapters(model: Path, root: Path, ranks: dict[str, int]) -> None:
    """PEFT LoRA folders `root/<name>` for the tiny model on all seven projections, saved by PEFT itself,
    with random factors large enough to change its greedy output."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    for seed, (name, rank) in enumerate(ranks.items()):
        torch.manual_seed(100 + seed)
        cfg = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, init_lora_weights=False,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(model), cfg)
        with torch.no_grad():
            for key, p in peft_model.named_parameters():
                if "lora_" in key:
                    p.normal_(0.0, 0.3)
        peft_model.save_pretrained(root / name)


@dataclass
class HttpStack:
    serve: ServiceProcess
    base_url: str            # http://HOST:PORT
    grpc_address: str
    compute_address: str

    def compute_busy(self) -> int:
        """Requests running or waiting on the compute service."""
        with grpc.insecure_channel(self.compute_address) as ch:
            stats = compute_pb2_grpc.ComputeStub(ch).GetStats(compute_pb2.GetStatsRequest(), timeout=10)
        return stats.num_running + stats.num_waiting

    def stop(self) -> int:
        return self.serve.stop()


def _find(svc: ServiceProcess, pattern: str, timeout_s: float = 15.0) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(svc.lines):
            m = re.search(pattern, line)
            if m:
                return m
        time.sleep(0.05)
    raise RuntimeError(f"no line matching {pattern!r} in:\n{svc.output()[-4000:]}")


def start_http_stack(model: Path, lora_root: Path, *extra: str) -> HttpStack:
    svc = start_service("serve", ["serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--device",
                                  "cpu", "--model", str(model), "--lora-root", str(lora_root), "--max-model-len",
                                  "4096", *extra], timeout_s=300)
    try:
        http = _find(svc, r"\[gateway\] gateway http listening on (\S+)").group(1)
        compute = _find(svc, r"serve: cache at \S+ \(\w+\), compute at (\S+),").group(1)
    except BaseException:
        svc.stop()
        raise
    return HttpStack(svc, f"http://{http}", svc.address, compute)
