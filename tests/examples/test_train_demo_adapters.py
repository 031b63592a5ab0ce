"""examples/train_demo_adapters.py: a few steps on a tiny model give PEFT folders that loraplex loads and that
change the engine's logits, and the same seed writes the same bytes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.formats import ModelSpec, load_adapter, validate

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_demo_adapters.py"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template, saved as a HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from loraplex.model_files import load_tokenizer

    folder = tmp_path_factory.mktemp("tiny")
    tok = load_tokenizer("")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=1)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def train(model: Path, out: Path, adapters: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), str(out), "--model", str(model), "--adapters", adapters,
           "--steps", "2", "--batch-size", "4", "--rank", "4", "--threads", "2", "--seed", "3", "--sample-prompt", ""]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory) -> tuple[Path, str]:
    """french and json, two steps each: (output folder, the script's stderr)."""
    out = tmp_path_factory.mktemp("adapters")
    return out, train(tiny_model, out, "french,json").stderr


def test_trained_adapters_load_and_change_logits(tiny_model, trained):
    out, stderr = trained
    assert "french" in stderr and "json" in stderr and "step" in stderr       # the progress bars
    spec = ModelSpec.from_path(tiny_model)
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_model), max_model_len=128), with_tokenizer=False)
    for name in ("french", "json"):
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (out / name).iterdir()}
        adapter = validate(load_adapter(out / name), spec, max_lora_rank=64)
        assert adapter.config.shape == (7 * 2, 3) and set(adapter.config[:, 0]) == set(range(1, 8))
        assert set(adapter.config[:, 2]) == {4}
        engine.add_adapter(name, adapter)

    prompt = [1, 9, 4, 200, 3000, 17, 2]
    for key in ("base", "french", "json"):
        engine.add_request(key, prompt, SamplingParams(max_tokens=1, temperature=0), None if key == "base" else key)
    _, logits = engine.step_with_logits()
    for name in ("french", "json"):
        assert (logits[name] - logits["base"]).abs().max() > 1e-4, name     # two steps of training move them
    assert not torch.equal(logits["french"], logits["json"])


def test_same_seed_same_bytes(tiny_model, trained, tmp_path):
    train(tiny_model, tmp_path, "json")               # alone: what else is trained does not change it
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        assert (trained[0] / "json" / f).read_bytes() == (tmp_path / "json" / f).read_bytes()
