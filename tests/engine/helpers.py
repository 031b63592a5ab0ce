"""Test helpers: tiny random transformers models, PEFT adapters, and PEFT -> converted Adapter."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from loraplex.formats.adapter import Adapter
from loraplex.formats.modules import HF_TO_MODULE_ID

TINY_DIMS = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_model(kind: str, seed: int = 0):
    """A random fp32 transformers model: "llama" (untied, llama3 rope), "qwen2" (qkv bias), "llama_tied"."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "qwen2":
        cfg = Qwen2Config(**TINY_DIMS, tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6)
        model = Qwen2ForCausalLM(cfg)
    else:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        cfg = LlamaConfig(**TINY_DIMS, tie_word_embeddings=kind == "llama_tied", rms_norm_eps=1e-5,
                          rope_parameters=rope if kind == "llama" else None)
        model = LlamaForCausalLM(cfg)
    # Random init is small; widen it so logits differ clearly between tokens and adapters matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
    return model.eval()


MID_DIMS = dict(vocab_size=128, hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)


# A rank-16 adapter on every projection, for the GPU tests of the engine's 4-bit kernels.
ALL_MODULES = dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"])


def w4_mid_llama(tmp_path_factory) -> tuple[Path, Path]:
    """(a 4-bit compressed-tensors copy of `mid_llama` in groups of 128, the folder holding its adapter "all"
    (ALL_MODULES)), made under pytest's `tmp_path_factory`."""
    from compute_service.engine.quant_formats.export import quantize_checkpoint

    src, adapters = tmp_path_factory.mktemp("mid"), tmp_path_factory.mktemp("adapters")
    mid_llama({"all": ALL_MODULES}, src, adapters)
    folder = quantize_checkpoint(src, tmp_path_factory.mktemp("w4") / "ct4", bits=4, group_size=128,
                                 progress=False).out
    return folder, adapters


def mid_llama(adapters: dict[str, dict], src: Path, adapter_dir: Path):
    """A random llama of MID_DIMS (projections large enough for the GPU's one-row kernels), saved to `src`, and
    PEFT `adapters` on it with B large enough to move the logits clearly, saved to `adapter_dir`; the PEFT model
    (on the GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MID_DIMS, rms_norm_eps=1e-5, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.03)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(src, safe_serialization=True)
    peft = add_peft_adapters(model, adapters).cuda()
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    peft.save_pretrained(adapter_dir)
    return peft


def assert_same_logits(first: dict, second: dict, tol: float = 2e-2, moved: float = 0.1, steps: int = 3) -> None:
    """first, second: {(request id, adapter key or None): (tokens, logits rows)} of two runs of the same requests.
    At every step whose prefix both runs share (the step where they first choose differently included) the logits
    agree within `tol` (relative), and each adapter moves the second run's logits more than `moved` from the first
    run's same request without one. The runs may choose differently only where `first`'s logits of the two tokens
    are within `tol` of its logit scale (a tie within rounding), after which nothing more is compared; short of such
    a tie at least `steps` steps of every request are compared."""
    for (rid, key), (tok_f, log_f) in first.items():
        tok_s, log_s = second[rid, key]
        base = first[rid, None][1]
        compared, tied = 0, False
        for i, (lf, ls) in enumerate(zip(log_f, log_s)):
            assert rel_err(lf, ls) < tol, (rid, key, i, rel_err(lf, ls))
            if key is not None and i < len(base):
                assert rel_err(ls, base[i]) > moved, (rid, key, i, "the adapter should move the logits")
            compared += 1
            if tok_f[i] != tok_s[i]:
                gap = float((lf[tok_f[i]].float() - lf[tok_s[i]].float()).abs() / lf.float().abs().max())
                assert gap <= tol, (rid, key, i, gap, "the runs chose differently without a tie")
                tied = True
                break
        assert tied or compared >= steps, (rid, key, tok_f, tok_s)


def w4_engine(folder: Path, adapters: Path, max_num_seqs: int):
    """An engine on the GPU over `w4_mid_llama`'s 4-bit model (kept quantized: its projections on the kernels)
    with its adapter "all" loaded."""
    from compute_service.engine import EngineConfig, LLMEngine
    from compute_service.engine.quant_linear import QuantLinear
    from loraplex.formats import read_peft

    engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", block_size=16,
                                    lora_backend="kernels", max_loras=2, max_num_seqs=max_num_seqs,
                                    quantization="keep"))
    assert isinstance(engine.loaded.model.weights.layers[0].gate_up, QuantLinear)
    engine.add_adapter("all", read_peft(adapters / "all"))
    return engine


def record_calls(monkeypatch, module, name: str, what) -> list:
    """Replaces module.name with a wrapper that calls it and records `what(*args, **kwargs)` of each call into the
    returned list (e.g. whether a launch took a LoRA delta)."""
    seen: list = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(what(*args, **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


def decode_alone(engine, key: str = "all", seed: int = 5, max_tokens: int = 10) -> dict:
    """Prompts "a" and "b" (6 random tokens each) decoded one request at a time (one-token steps), each with
    adapter `key` and without one: {(request id, key or None): (tokens, logits rows)}, for `assert_same_logits`."""
    from compute_service.engine import SamplingParams
    from test_parity import run_collecting

    g = torch.Generator().manual_seed(seed)
    out = {}
    for rid in ("a", "b"):
        prompt = torch.randint(0, MID_DIMS["vocab_size"], (6,), generator=g).tolist()
        for k in (key, None):
            tokens, logits = run_collecting(engine, {rid: (prompt, k)},
                                            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            out[rid, k] = (tokens[rid], logits[rid])
    return out


def assert_logits_agree(first: dict, second: dict, tol: float = 2e-2) -> None:
    """first, second: {request id: (tokens, logits rows)} of two runs of the same requests. At every step whose
    prefix both runs share (the step where they first choose differently included) the logits agree within `tol`
    (relative to the logit scale); they may choose differently only where `first`'s logits of the two tokens are
    within `tol` of that scale of each other (a tie within rounding), after which nothing more is compared."""
    for rid, (tok_f, log_f) in first.items():
        tok_s, log_s = second[rid]
        assert log_f and log_s, (rid, "no logits")
        for i, (a, b) in enumerate(zip(log_f, log_s)):
            assert rel_err(a, b) < tol, (rid, i, rel_err(a, b))
            if tok_f[i] != tok_s[i]:
                gap = float((a[tok_f[i]].float() - a[tok_s[i]].float()).abs() / a.float().abs().max())
                assert gap <= tol, (rid, i, gap, "the runs chose differently without a tie")
                break


def save_tiny(model, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def peft_adapter_to_converted(peft_model, adapter_name: str) -> Adapter:
    """Each lora_A/lora_B pair -> one row A.flatten() ++ (scale * B).flatten(), zero-padded."""
    from peft.tuners.lora import Linear as LoraLinear

    rows, configs, in_out = [], [], []
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLinear) or adapter_name not in module.lora_A:
            continue
        m = re.search(r"layers\.(\d+)\..*\.(\w+_proj)$", name)
        assert m, name
        a = module.lora_A[adapter_name].weight.detach().float()          # [r, in]
        b = module.lora_B[adapter_name].weight.detach().float() * module.scaling[adapter_name]  # [out, r]
        configs.append([HF_TO_MODULE_ID[m.group(2)], int(m.group(1)), a.shape[0]])
        rows.append(torch.cat([a.flatten(), b.flatten()]))
        in_out.append((a.shape[1], b.shape[0]))
    width = max(r.numel() for r in rows)
    weights = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        weights[i, : r.numel()] = r
    return Adapter(config=np.asarray(configs, dtype=np.int32), weights=weights, in_out=tuple(in_out))


def add_peft_adapters(model, specs: dict[str, dict], seed: int = 1):
    """Wraps `model` in PEFT with one random (non-zero B) adapter per LoraConfig kwargs in `specs`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = None
    for name, kwargs in specs.items():
        cfg = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kwargs)
        if peft_model is None:
            peft_model = get_peft_model(model, cfg, adapter_name=name)
        else:
            peft_model.add_adapter(name, cfg)
    with torch.no_grad():   # random B so every delta is visible
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.1)
    return peft_model.eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the logit scale of b."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())
