"""Model loading: sharded safetensors, GGUF (q/k un-permuted), fingerprints, and clear errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from compute_service.engine import ModelLoadError, UnsupportedModelError, load_model
from compute_service.engine.attention import AttentionMetadata
from compute_service.engine.kv_cache import allocate_kv_cache
from helpers import TINY_DIMS, rel_err
from quant_helpers import write_tiny_gguf


def prefill_logits(loaded, tokens: list[int]) -> torch.Tensor:
    """All-position logits of one prompt through our model: [n, V]."""
    n = len(tokens)
    kv = allocate_kv_cache(loaded.spec, 8, 16, torch.float32, torch.device("cpu"))
    meta = AttentionMetadata.build([n], [n], [list(range(-(-n // 16)))], 16, torch.device("cpu"))
    hidden = loaded.model.forward(torch.tensor(tokens), torch.arange(n), meta, kv)
    return loaded.model.compute_logits(hidden)


def test_sharded_folder_loads_the_same_weights(tiny_models, tmp_path):
    model, folder = tiny_models["qwen2"]
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    a, b = load_model(folder), load_model(tmp_path)
    assert torch.equal(a.model.weights.layers[1].gate_up.weight, b.model.weights.layers[1].gate_up.weight)
    assert a.fingerprint == b.fingerprint


def test_fingerprint_depends_on_weights_not_dtype(tiny_models):
    llama = load_model(tiny_models["llama"][1])
    assert load_model(tiny_models["llama"][1], dtype=torch.bfloat16).fingerprint == llama.fingerprint
    assert load_model(tiny_models["llama_tied"][1]).fingerprint != llama.fingerprint
    assert llama.model.weights.embed.dtype == torch.float32


def test_gguf_loads_with_llama_cpp_layout(tiny_models, tmp_path):
    model, _ = tiny_models["llama_tied"]
    path = write_tiny_gguf(model, tmp_path / "tiny.gguf", {}, fields={"tokenizer.ggml.eos_token_id": 2})
    loaded = load_model(path)
    assert loaded.spec.tie_word_embeddings and loaded.spec.eos_token_ids == (2,)
    tokens = torch.randint(0, TINY_DIMS["vocab_size"], (11,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0]
    assert rel_err(prefill_logits(loaded, tokens), ref) < 1e-4


def test_bad_paths_and_architectures_are_clear(tiny_models, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "missing")
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["llama"][1], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="model.layers.2"):
        load_model(folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(folder)
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="neither"):
        load_model(tmp_path / "x.txt")
