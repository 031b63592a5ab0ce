"""Quantized checkpoints load kept quantized: each projection is a QuantLinear holding exactly the written
codes, and the model's logits equal the same checkpoint dequantized (`--quantization none`) to rounding.

Checkpoints: AWQ, compressed-tensors and GPTQ (4- and 8-bit, symmetric and asymmetric) written by `loraplex
quantize`'s writer, GPTQ (v1 and v2 zero conventions) packed from the format's definition, and a GGUF
whose projections are Q4_0 / Q4_1 / Q8_0 (q/k rows permuted as the GGUF converter does) with fused
groups of mixed types, which are dequantized.
"""
from __future__ import annotations

import json

import pytest
import torch

from compute_service.engine import load_model
from compute_service.engine.linear import Linear
from compute_service.engine.mlp_order import in_model_order
from compute_service.engine.model import LAYER_PROJECTIONS
from compute_service.engine.quant_formats.export import quantize_checkpoint
from compute_service.engine.quant_formats.summary import describe_projections
from compute_service.engine.quant_linear import QuantLinear
from compute_service.engine.quantized import quantize_rtn
from helpers import TINY_DIMS, rel_err
from quant_helpers import GGUF_TYPES, gptq_tensors, projection_weights, write_gptq_folder, write_tiny_gguf
from test_loader import prefill_logits

G = 16          # divides the tiny model's 64 hidden and 80 intermediate features
KINDS = {       # name -> (model kind, writer arguments)
    "awq": ("llama", dict(fmt="awq", bits=4, symmetric=False)),
    "ct4-sym": ("qwen2", dict(fmt="compressed-tensors", bits=4, symmetric=True)),
    "ct8-asym": ("llama", dict(fmt="compressed-tensors", bits=8, symmetric=False)),
    "gptq4-asym": ("llama", dict(fmt="gptq", bits=4, symmetric=False)),
    "gptq8-sym": ("qwen2", dict(fmt="gptq", bits=8, symmetric=True)),
}
TOKENS = torch.randint(0, TINY_DIMS["vocab_size"], (13,), generator=torch.Generator().manual_seed(5)).tolist()


GPTQ = {"gptq": ("gptq", False), "gptq_v2": ("gptq_v2", False), "gptq-act-order": ("gptq", True)}


@pytest.fixture(scope="module")
def folders(tiny_models, tmp_path_factory):
    """name -> (transformers model, quantized folder, writer arguments, each projection's weight as written)."""
    out = {}
    for name, (kind, kw) in KINDS.items():
        model, src = tiny_models[kind]
        written = {prefix: quantize_rtn(w, kw["bits"], G, symmetric=kw["symmetric"]).dequantize()
                   for prefix, w in projection_weights(model).items()}
        out[name] = (model, quantize_checkpoint(src, tmp_path_factory.mktemp(name) / "q", group_size=G,
                                                progress=False, **kw).out, kw, written)
    model, src = tiny_models["llama"]
    for name, (fmt, act_order) in GPTQ.items():
        folder, written = write_gptq_folder(model, src, tmp_path_factory.mktemp(name) / "q", 4, G, fmt, act_order)
        out[name] = (model, folder, dict(bits=4, symmetric=True), written)
    return out


def layers_of(loaded):
    return [(i, name, getattr(lw, name)) for i, lw in enumerate(loaded.model.weights.layers)
            for name in LAYER_PROJECTIONS]


def model_order(loaded, i: int, proj: str) -> torch.Tensor:
    """Layer i's projection dequantized, its intermediate features in the model's order (`mlp_order.py`)."""
    lw = loaded.model.weights.layers[i]
    return in_model_order(proj, getattr(lw, proj).dequantize(), lw.mlp_order)


@pytest.mark.parametrize("name", list(KINDS) + list(GPTQ))
def test_loads_kept_quantized_with_the_written_codes(folders, name):
    """(Act-order: the codes kept sorted by group, `perm` naming each stored column's input channel.)"""
    model, folder, kw, weights = folders[name]
    kept, dense = load_model(folder, quantization="keep"), load_model(folder, quantization="none")
    fused = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
             "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
    act_order = name.endswith("act-order")
    for i, proj, layer in layers_of(kept):
        assert isinstance(layer, QuantLinear) and layer.bits == kw["bits"] and layer.group_size == G
        # down's act-order is taken by gate/up's rows: down reads act in its stored order
        assert (layer.qweight.perm is not None) == (act_order and proj != "down"), (i, proj)
        assert (kept.model.weights.layers[i].mlp_order is not None) == act_order
        written = torch.cat([weights[f"model.layers.{i}.{p}"] for p in fused[proj]])
        assert torch.equal(model_order(kept, i, proj), written), (i, proj)
        assert torch.equal(getattr(dense.model.weights.layers[i], proj).weight, written), (i, proj)
    assert kept.fingerprint == dense.fingerprint
    assert ("act-order" in describe_projections(kept.model.weights, torch.float32)) == name.endswith("act-order")
    assert all(isinstance(layer, Linear) for _, _, layer in layers_of(dense))
    a, b = prefill_logits(kept, TOKENS), prefill_logits(dense, TOKENS)
    assert rel_err(a, b) < 1e-5
    with torch.no_grad():   # and it is still the model it was quantized from, within quantization error
        original = model(torch.tensor([TOKENS])).logits[0]
    assert rel_err(a, original) < (0.02 if kw["bits"] == 8 else 0.5)


def test_auto_dequantizes_on_the_cpu(folders, caplog):
    _, folder, _, _ = folders["awq"]
    with caplog.at_level("INFO"):
        loaded = load_model(folder)
    assert all(isinstance(layer, Linear) for _, _, layer in layers_of(loaded))
    assert "awq checkpoint: quantized projections dequantized to float32 (--quantization auto on the CPU" \
        in caplog.text


def test_a_group_size_that_does_not_divide_stays_dense(tiny_models, tmp_path, caplog):
    model, src = tiny_models["llama"]
    r = quantize_checkpoint(src, tmp_path / "q", group_size=32, fmt="awq", progress=False)   # 32 does not divide 80
    assert r.not_converted == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert cfg["modules_to_not_convert"] == r.not_converted and cfg["version"] == "gemm"
    with caplog.at_level("INFO"):
        kept = load_model(tmp_path / "q", quantization="keep")
    kinds = {(name, type(layer).__name__) for _, name, layer in layers_of(kept)}
    assert kinds == {("qkv", "QuantLinear"), ("o", "QuantLinear"), ("gate_up", "QuantLinear"), ("down", "Linear")}
    assert "6 of 8 projections kept quantized (4-bit group 32: 6); dense: layers.0.mlp.down_proj (stored dense)" \
        in caplog.text
    assert rel_err(prefill_logits(kept, TOKENS), prefill_logits(load_model(tmp_path / "q", quantization="none"),
                                                                 TOKENS)) < 1e-5




def test_gguf_q4_q8_projections_kept_quantized(tiny_models, tmp_path, caplog):
    model, _ = tiny_models["llama_tied"]
    path = write_tiny_gguf(model, tmp_path / "tiny.gguf", GGUF_TYPES)
    with caplog.at_level("INFO"):
        kept = load_model(path, quantization="keep")
    dense = load_model(path, quantization="none")
    got = {(i, name): (layer.bits, layer.group_size) if isinstance(layer, QuantLinear) else None
           for i, name, layer in layers_of(kept)}
    assert got == {(0, "qkv"): (4, 32), (0, "o"): (8, 32), (0, "gate_up"): (4, 32), (0, "down"): None,
                   (1, "qkv"): None, (1, "o"): (4, 32), (1, "gate_up"): None, (1, "down"): None}
    assert "layers.1.self_attn.q_proj + layers.1.self_attn.k_proj + layers.1.self_attn.v_proj " \
           "(fused parts stored 4-bit g32/8-bit g32/4-bit g32)" in caplog.text
    for (i, name), kind in got.items():
        if kind is not None:       # q/k rows un-permuted exactly as the dense path does
            layer = getattr(kept.model.weights.layers[i], name)
            assert torch.equal(layer.dequantize(), getattr(dense.model.weights.layers[i], name).weight)
    assert kept.fingerprint == dense.fingerprint
    assert rel_err(prefill_logits(kept, TOKENS), prefill_logits(dense, TOKENS)) < 1e-5


def test_gguf_k_quant_projections_kept_quantized(tmp_path):
    """Q4_K / Q5_K projections (the usual Q4_K_M / Q5_K_M files' types) stay quantized: groups of 32, 4-bit
    and 8-bit codes (Q5_K's 5-bit codes in bytes), equal to the file's dequantization to float16 rounding of
    their scales; the model's logits are the dense load's to that rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         max_position_embeddings=128)).eval()
    types = {f"{i}.{p}": kind for i in range(2) for p, kind in (
        ("self_attn.q_proj", "Q4_K"), ("self_attn.k_proj", "Q4_K"), ("self_attn.v_proj", "Q4_K"),
        ("self_attn.o_proj", "Q5_K"), ("mlp.gate_proj", "Q4_K"), ("mlp.up_proj", "Q4_K"), ("mlp.down_proj", "Q8_0"))}
    path = write_tiny_gguf(model, tmp_path / "k.gguf", types)
    kept, dense = load_model(path, quantization="keep"), load_model(path, quantization="none")
    got = {name: (layer.bits, layer.group_size) for _, name, layer in layers_of(kept) if isinstance(layer, QuantLinear)}
    assert got == {"qkv": (4, 32), "o": (8, 32), "gate_up": (4, 32), "down": (8, 32)}
    for i, name, layer in layers_of(kept):
        want = getattr(dense.model.weights.layers[i], name).weight
        assert rel_err(layer.dequantize(), want) < 1e-3, (i, name)
    assert kept.fingerprint == dense.fingerprint
    assert rel_err(prefill_logits(kept, TOKENS), prefill_logits(dense, TOKENS)) < 1e-3


@pytest.mark.gpu
def test_gpu_load_of_mixed_fused_parts(tiny_models, tmp_path):
    """On a GPU, block types dequantize there and other types on the host: fused parts that mix them (layer 1's
    Q8_0 gate and F32 up, kept dense) load, with the host load's weights and fingerprint."""
    model, _ = tiny_models["llama_tied"]
    path = write_tiny_gguf(model, tmp_path / "tiny.gguf", GGUF_TYPES)
    for mode in ("keep", "none"):
        host, gpu = load_model(path, quantization=mode), load_model(path, quantization=mode, device="cuda")
        assert host.fingerprint == gpu.fingerprint
        for (i, name, a), (_, _, b) in zip(layers_of(host), layers_of(gpu)):
            wa = a.dequantize() if isinstance(a, QuantLinear) else a.weight
            wb = b.dequantize() if isinstance(b, QuantLinear) else b.weight
            assert torch.equal(wa, wb.cpu()), (mode, i, name)


def test_a_dense_gguf_is_not_reported_as_quantized(tiny_models, tmp_path, caplog):
    model, _ = tiny_models["llama_tied"]
    path = write_tiny_gguf(model, tmp_path / "f32.gguf", {})
    with caplog.at_level("INFO"):
        loaded = load_model(path, quantization="keep")
    assert all(isinstance(layer, Linear) for _, _, layer in layers_of(loaded))
    assert "quantized" not in caplog.text


@pytest.mark.parametrize("name", ["ct4-sym", "ct8-asym"])
def test_compressed_tensors_own_reader_reads_our_folders(folders, name):
    """compressed-tensors' decompressor (and, for the symmetric folder, transformers' loader through it)
    reads what `loraplex quantize` wrote as the weights we load."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    model, folder, kw, _ = folders[name]
    cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**cfg["config_groups"]["group_0"]["weights"])
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    stored = load_file(str(folder / "model.safetensors"))
    kept = load_model(folder, quantization="keep")
    for prefix in projection_weights(model):
        part = {k.removeprefix(prefix + "."): v for k, v in stored.items() if k.startswith(prefix + ".weight_")}
        theirs = PackedQuantizationCompressor.decompress(part, scheme)["weight"].float()
        i, proj = int(prefix.split(".")[2]), prefix.split(".")[-1]
        layer = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
                 "up_proj": "gate_up", "down_proj": "down"}[proj]
        ours = model_order(kept, i, layer)
        start = {"k_proj": kept.spec.q_size, "v_proj": kept.spec.q_size + kept.spec.kv_size,
                 "up_proj": kept.spec.intermediate_size}.get(proj, 0)
        ours = ours[start: start + theirs.shape[0]]
        assert torch.allclose(ours, theirs, rtol=0, atol=float(theirs.abs().max()) * 2 ** -9), prefix
    if kw["symmetric"]:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        with torch.no_grad():
            ref = hf(torch.tensor([TOKENS])).logits[0]
        assert rel_err(prefill_logits(kept, TOKENS), ref) < 1e-4


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_act_order_runs_on_the_kernels_with_x_gathered(rows):
    """The packed path (Triton's interpreter here) reads x in the stored (by group) order: one row, a few
    rows, and rows past the switch to dequantize + GEMM (set to 4 here) all equal x @ W^T, W as the GPTQ
    tensors define it."""
    from compute_service.engine.quant_formats import gptq

    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 128, generator=gen)
    tensors, want_w = gptq_tensors(w, 4, 32, torch.randperm(128, generator=gen))
    qw = gptq.reader({"bits": 4, "group_size": 32, "desc_act": True}, {"p" + k: v for k, v in tensors.items()}.get)("p")
    assert qw.perm is not None and torch.equal(qw.dequantize(), want_w)
    kernel = QuantLinear(qw, None, torch.device("cpu"), use_kernel=True, dense_min_tokens=4)
    x = torch.randn(rows, 128, generator=gen)
    assert rel_err(kernel(x), x @ want_w.t()) < 1e-5
    assert torch.equal(kernel.dequantize(), want_w) and not kernel.takes_addend(x[:1])


@pytest.mark.parametrize("symmetric,act_order", [(True, True), (True, False), (False, True)])
def test_the_gptq_writer_packs_as_the_format_defines(symmetric, act_order):
    """`gptq.tensors` (what `loraplex quantize --format gptq` writes) equals the tensors packed from the format's
    definition (symmetric), and the reader gives back the weight it was quantized to (asymmetric too)."""
    from compute_service.engine.quant_formats import gptq

    gen = torch.Generator().manual_seed(int(symmetric) * 2 + int(act_order))
    w = torch.randn(48, 128, generator=gen)
    order = torch.randperm(128, generator=gen) if act_order else torch.arange(128)
    qw = quantize_rtn(w[:, order], 4, 32, symmetric=symmetric)
    ours = gptq.tensors("", qw, order if act_order else None)
    if symmetric:
        theirs, _ = gptq_tensors(w, 4, 32, order)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[name], theirs[name]) for name in ours), [n for n in ours
                                                                             if not torch.equal(ours[n], theirs[n])]
    back = gptq.reader({"bits": 4, "group_size": 32, "desc_act": act_order}, ours.get)("")
    assert (back.perm is not None) == act_order
    assert torch.equal(back.dequantize(), torch.empty(w.shape).index_copy_(1, order, qw.dequantize()))


def test_an_act_order_layout_written_by_the_exporter_serves_kept_quantized(tiny_models, tmp_path):
    """`act_order_seed`: each input's channels in one random order (q/k/v alike, gate/up alike), so every fused
    projection loads kept quantized with a perm, and the model equals its dequantized load to rounding."""
    model, src = tiny_models["llama"]
    with pytest.raises(ValueError, match="act-order layout is a GPTQ one"):
        quantize_checkpoint(src, tmp_path / "awq", fmt="awq", group_size=G, act_order_seed=1, progress=False)
    folder = quantize_checkpoint(src, tmp_path / "q", fmt="gptq", group_size=G, symmetric=True, act_order_seed=1,
                                 progress=False).out
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["desc_act"] is True
    kept, dense = load_model(folder, quantization="keep"), load_model(folder, quantization="none")
    perms = set()
    for i, proj, layer in layers_of(kept):
        perm = kept.model.weights.layers[i].mlp_order if proj == "down" else layer.qweight.perm
        assert isinstance(layer, QuantLinear) and perm is not None, (i, proj)
        perms.add(tuple(perm.tolist()))
        assert torch.equal(model_order(kept, i, proj), getattr(dense.model.weights.layers[i], proj).weight), (i, proj)
    assert len(perms) == 8                  # one order per input of each layer, none the model's own
    a = prefill_logits(kept, TOKENS)
    assert rel_err(a, prefill_logits(dense, TOKENS)) < 1e-5
    with torch.no_grad():
        assert rel_err(a, model(torch.tensor([TOKENS])).logits[0]) < 0.5


def test_act_order_fused_parts_in_different_orders_load_dense(folders, tmp_path):
    """q/k/v (gate/up) read the same input, so GPTQ gives them one channel order; a checkpoint where they
    differ cannot share one gather: that fused projection is dequantized, the others stay quantized."""
    from safetensors.torch import load_file, save_file

    _, folder, _, weights = folders["gptq-act-order"]
    other = tmp_path / "q"
    other.mkdir()
    (other / "config.json").write_text((folder / "config.json").read_text())
    stored = load_file(str(folder / "model.safetensors"))
    prefix = "model.layers.0.self_attn.k_proj"       # its g_idx and codes moved to another channel order
    k = weights[prefix].shape[1]
    new = torch.randperm(k, generator=torch.Generator().manual_seed(11))
    g_idx = stored[prefix + ".g_idx"].long()
    from compute_service.engine.quant_formats.packing import pack_int32, unpack_int32
    q = unpack_int32(stored[prefix + ".qweight"], 4, dim=0)                       # [K, N] by channel
    stored[prefix + ".qweight"] = pack_int32(q[new].contiguous(), 4, dim=0)
    stored[prefix + ".g_idx"] = g_idx[new].int()
    save_file(stored, str(other / "model.safetensors"))
    kept = load_model(other, quantization="keep")
    assert isinstance(kept.model.weights.layers[0].qkv, Linear)
    assert isinstance(kept.model.weights.layers[0].gate_up, QuantLinear)
    assert isinstance(kept.model.weights.layers[1].qkv, QuantLinear)


def test_layer_projections_name_every_linear_of_a_layer():
    """Loaders, summaries and benchmarks walk a layer's projections by LAYER_PROJECTIONS."""
    import dataclasses

    from compute_service.engine.model import LayerWeights
    linear = tuple(f.name for f in dataclasses.fields(LayerWeights) if f.type in ("Linear", Linear))
    assert linear == LAYER_PROJECTIONS
