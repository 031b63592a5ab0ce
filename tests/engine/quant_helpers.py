"""Quantized tiny checkpoints for tests: made with `loraplex quantize`'s writer, a GPTQ folder packed
from the format's definition, and a GGUF with Q4_0 / Q4_1 / Q8_0 projections."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from compute_service.engine.quant_formats.export import INPUT_GROUPS, PROJECTIONS
from compute_service.engine.quant_formats.gguf import K_TYPES, KEPT_TYPES
from compute_service.engine.quant_formats.packing import pack_int32
from compute_service.engine.quantized import quantize_rtn


def projection_weights(model) -> dict[str, torch.Tensor]:
    """HF prefix -> dense [N, K] weight of every projection of a transformers model."""
    sd = model.state_dict()
    return {f"model.layers.{i}.{p}": sd[f"model.layers.{i}.{p}.weight"].detach().float()
            for i in range(model.config.num_hidden_layers) for p in PROJECTIONS}


def gptq_tensors(w: torch.Tensor, bits: int, group_size: int, order: torch.Tensor,
                 fmt: str = "gptq") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One projection's GPTQ tensors (symmetric; names from `.qweight`) with its input channels quantized in
    `order` (groups of consecutive channels in that order: act-order unless it is arange), and the weight as
    the file defines it, channels in the model's order."""
    k = w.shape[1]
    qw = quantize_rtn(w[:, order], bits, group_size, symmetric=True)      # groups along `order`
    q = torch.empty_like(qw.q).index_copy_(1, order, qw.q)                   # codes in the model's order
    g_idx = torch.empty(k, dtype=torch.int32).index_copy_(0, order, (torch.arange(k) // group_size).int())
    z = torch.full(qw.scales.shape, 1 << (bits - 1), dtype=torch.int32) - (1 if fmt == "gptq" else 0)
    return ({".qweight": pack_int32(q.t(), bits, dim=0),                                # [K/f, N]
             ".qzeros": pack_int32(z.t().to(torch.uint8), bits, dim=1),                 # [K/G, N/f]
             ".scales": qw.scales.t().contiguous(),                                     # [K/G, N]
             ".g_idx": g_idx},
            torch.empty(w.shape).index_copy_(1, order, qw.dequantize()))


def write_gptq_folder(model, src: Path, out: Path, bits: int, group_size: int, fmt: str = "gptq",
                      act_order: bool = False) -> tuple[Path, dict[str, torch.Tensor]]:
    """A GPTQ folder (symmetric, sequential packing; `gptq` stores z - 1) of `model`'s projections, and each
    projection's weight as the file defines it (dequantized, input channels in the model's order).
    `act_order`: channels quantized in a random order per input (as desc_act does by the Hessian), groups of
    consecutive channels in that order, the codes stored in the model's order with g_idx naming the groups."""
    orders: dict[str, torch.Tensor] = {}

    def stored(prefix: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        k = w.shape[1]
        layer, proj = prefix.rsplit(".", 2)[0], prefix.split(".", 3)[3]
        gen = torch.Generator().manual_seed(len(orders) + 7)
        order = orders.setdefault(f"{layer}.{INPUT_GROUPS[proj]}",
                                  torch.randperm(k, generator=gen) if act_order else torch.arange(k))
        return gptq_tensors(w, bits, group_size, order, fmt)

    qcfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": True, "desc_act": act_order,
            "checkpoint_format": fmt}
    return write_stored_folder(model, src, out, qcfg, stored)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The GGUF converter's q/k row order (halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Projections of the tiny models' GGUF kept 4- or 8-bit (layer 1: mixed fused groups); the rest F32.
GGUF_TYPES = {"0.self_attn.q_proj": "Q4_0", "0.self_attn.k_proj": "Q4_0", "0.self_attn.v_proj": "Q4_0",
              "0.self_attn.o_proj": "Q8_0", "0.mlp.gate_proj": "Q4_1", "0.mlp.up_proj": "Q4_1",
              "1.self_attn.q_proj": "Q4_1", "1.self_attn.k_proj": "Q8_0", "1.self_attn.v_proj": "Q4_1",
              "1.mlp.gate_proj": "Q8_0", "1.self_attn.o_proj": "Q4_1"}

GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def random_blocks(tensor_type: int, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Raw rows of a GGUF tensor of one of `quant_formats.gguf.KEPT_TYPES`: random codes (and K-quant
    sub-block scales), float16 scales d (and minimums: Q4_1's m, the K-quants' dmin) of all signs."""
    _, nbytes, _ = KEPT_TYPES[tensor_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    scales = (rng.standard_normal((rows, blocks)) * 0.02).astype(np.float16)
    raw[..., :2] = scales[..., None].view(np.uint8).reshape(rows, blocks, 2)
    if tensor_type in (3, *K_TYPES):                                # a float16 minimum (dmin) after d
        mins = (rng.standard_normal((rows, blocks)) * 0.1).astype(np.float16)
        raw[..., 2:4] = mins[..., None].view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * nbytes)


def write_tiny_gguf(model, path: Path, types: dict[str, str], rope_freqs: np.ndarray | None = None,
                    fields: dict[str, object] | None = None) -> Path:
    """A tiny Llama as GGUF (its own output.weight when untied); `types` maps `{layer}.{projection}` to Q4_0 /
    Q4_1 / Q8_0 (quantized from the model) or Q4_K / Q5_K (random super-blocks; in features a multiple of
    256), others F32; `rope_freqs`: the per-frequency divisors tensor of Llama 3.1+ files; `fields`:
    extra metadata (key -> str, int (uint32) or float)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, cfg.num_hidden_layers), (w.add_embedding_length, cfg.hidden_size),
                       (w.add_feed_forward_length, cfg.intermediate_size), (w.add_head_count, cfg.num_attention_heads),
                       (w.add_head_count_kv, cfg.num_key_value_heads), (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                       (w.add_context_length, cfg.max_position_embeddings), (w.add_vocab_size, cfg.vocab_size),
                       (w.add_rope_freq_base, (cfg.rope_parameters or {}).get("rope_theta", 10000.0))):
        add(value)
    for key, value in (fields or {}).items():
        (w.add_string if isinstance(value, str) else w.add_uint32 if isinstance(value, int) else w.add_float32)(
            key, value)
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for i in range(cfg.num_hidden_layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[f"model.layers.{i}.input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[f"model.layers.{i}.post_attention_layernorm.weight"])
        for hf, short in GGUF_NAMES.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if short in ("attn_q", "attn_k"):
                t = _permute(t, cfg.num_attention_heads if short == "attn_q" else cfg.num_key_value_heads)
            kind = types.get(f"{i}.{hf}")
            if kind is None:
                w.add_tensor(f"blk.{i}.{short}.weight", np.ascontiguousarray(t))
                continue
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            if int(qtype) in K_TYPES:       # the package cannot quantize to these: random super-blocks instead
                data = random_blocks(int(qtype), t.shape[0], t.shape[1] // 256, seed=100 * i + len(hf))
            else:
                data = gguf.quants.quantize(np.ascontiguousarray(t), qtype)
            w.add_tensor(f"blk.{i}.{short}.weight", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_stored_folder(model, src: Path, out: Path, qcfg: dict,
                        stored: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]
                        ) -> tuple[Path, dict[str, torch.Tensor]]:
    """A HF folder of `model` (saved at `src`) whose projections are stored as `stored(prefix, weight)` gives
    them (tensors by suffix of the projection's name, and the weight they define), with `qcfg` as its
    quantization_config; and the defined weights by projection prefix."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    defined = {}
    for prefix, w in projection_weights(model).items():
        part, defined[prefix] = stored(prefix, w)
        del tensors[prefix + ".weight"]
        tensors.update({prefix + suffix: t for suffix, t in part.items()})
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(out / "model.safetensors"))
    return out, defined


def with_weights(model, defined: dict[str, torch.Tensor]):
    """A copy of `model` whose projections hold `defined` (by prefix): the reference a checkpoint that stores
    those weights should match."""
    import copy

    reference = copy.deepcopy(model)
    sd = reference.state_dict()
    with torch.no_grad():
        for prefix, w in defined.items():
            sd[prefix + ".weight"].copy_(w)
    return reference


def check_loads_dequantized(folder: Path, reference, tokens: list[int], caplog, says: str) -> None:
    """In both `keep` and `none` modes every projection loads dense, the logits are the reference model's, and
    the start-up log says `says` and that the weights were dequantized at load."""
    from compute_service.engine import load_model
    from compute_service.engine.linear import Linear
    from compute_service.engine.model import LAYER_PROJECTIONS
    from helpers import rel_err
    from test_loader import prefill_logits

    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0]
    for mode in ("keep", "none"):
        with caplog.at_level("INFO"):
            loaded = load_model(folder, quantization=mode)
        assert all(isinstance(getattr(lw, n), Linear) for lw in loaded.model.weights.layers for n in LAYER_PROJECTIONS)
        assert rel_err(prefill_logits(loaded, tokens), want) < 1e-5, mode
    assert says in caplog.text and "dequantized at load" in caplog.text
