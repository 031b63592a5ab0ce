"""Quantized checkpoint readers against each format's definition, packed here by hand (Python integers,
field by field), and against the formats' own tools where they are installed.

Every reader must give w[n, k] = q * s + float16(-z * s) exactly, from tensors laid out as the format's
documentation says (shapes, packed dimension, nibble order, zero-point conventions).
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from compute_service.engine.errors import UnsupportedModelError
from compute_service.engine.quant_formats import awq, compressed_tensors, gptq, keeps_quantized
from compute_service.engine.quant_formats.gguf import block_weight
from compute_service.engine.quant_formats.packing import AWQ_ORDER, pack_int32, unpack_int32
from compute_service.engine.quant_formats.source import QuantizedSource, hf_quantized_source
from compute_service.engine.quantized import QuantizedWeight

N, K, G = 16, 64, 16


def random_codes(bits: int, shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randint(0, 1 << bits, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def random_scales(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) * 0.05 + 0.001).to(torch.float16)


def hand_pack(codes: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Packs along the last axis from the written definition: field i of word j = element j*f + order[i]."""
    f = 32 // bits
    order = order or tuple(range(f))
    rows, cols = codes.shape
    out = np.zeros((rows, cols // f), dtype=np.int64)
    for r in range(rows):
        for j in range(cols // f):
            word = 0
            for i in range(f):
                word |= int(codes[r, j * f + order[i]]) << (bits * i)
            out[r, j] = word - (1 << 32) if word >= 1 << 31 else word
    return out.astype(np.int32)


def want_weight(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 from codes [N, K], scales and integer zeros [N, K/G]: q * s + float16(-z * s)."""
    g = q.shape[1] // s.shape[1]
    off = (-z.float() * s.float()).to(torch.float16).float()
    return q.float() * s.float().repeat_interleave(g, 1) + off.repeat_interleave(g, 1)


@pytest.mark.parametrize("bits,order", [(4, None), (8, None), (2, None), (4, AWQ_ORDER)])
def test_packing_matches_the_hand_packed_definition(bits, order):
    codes = random_codes(bits, (5, 32), seed=bits)
    words = torch.from_numpy(hand_pack(codes.numpy(), bits, order))
    assert torch.equal(pack_int32(codes, bits, dim=1, order=order), words)
    assert torch.equal(unpack_int32(words, bits, dim=1, order=order), codes)
    assert torch.equal(pack_int32(codes.t(), bits, dim=0, order=order), words.t())
    assert torch.equal(unpack_int32(words.t().contiguous(), bits, dim=0, order=order), codes.t())
    # AWQ: the second field of a word holds the third column (order 0 2 4 6 1 3 5 7)
    if order == AWQ_ORDER:
        assert (int(words[0, 0]) >> 4) & 0xF == int(codes[0, 2])


def test_packing_refuses_codes_that_do_not_fit():
    for bad in (16, -1):
        with pytest.raises(ValueError, match="does not fit in 4 bits"):
            pack_int32(torch.tensor([[0, 1, 2, 3, 4, 5, 6, bad]], dtype=torch.int32), 4, dim=1)


def test_awq_reader_follows_the_gemm_layout():
    q, z = random_codes(4, (N, K), 1), random_codes(4, (N, K // G), 2)
    s = random_scales((N, K // G), 3)
    raw = {"p.qweight": torch.from_numpy(hand_pack(q.t().numpy(), 4, AWQ_ORDER)),      # [K, N/8]
           "p.qzeros": torch.from_numpy(hand_pack(z.t().numpy(), 4, AWQ_ORDER)),       # [K/G, N/8]
           "p.scales": s.t().contiguous()}                                             # [K/G, N]
    read = awq.reader({"quant_method": "awq", "bits": 4, "group_size": G, "version": "GEMM"}, raw.get)
    qw = read("p")
    assert qw.group_size == G and qw.bits == 4 and torch.equal(qw.q, q)
    assert torch.equal(qw.dequantize(), want_weight(q, s, z))
    assert read("dense") is None
    with pytest.raises(UnsupportedModelError, match="GEMV|gemv"):
        awq.reader({"bits": 4, "version": "gemv"}, raw.get)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_reader_handles_both_zero_conventions(bits, fmt):
    q, z = random_codes(bits, (N, K), 4), random_codes(bits, (N, K // G), 5)
    z[0, 0] = 0                                        # v1 stores z - 1 = -1, wrapped to all ones in its field
    s = random_scales((N, K // G), 6)
    stored = (z.int() - (1 if fmt == "gptq" else 0)) & ((1 << bits) - 1)
    raw = {"p.qweight": torch.from_numpy(hand_pack(q.numpy(), bits)).t().contiguous(),  # [K/f, N]: along K
           "p.qzeros": torch.from_numpy(hand_pack(stored.t().numpy().astype(np.uint8), bits)),  # [K/G, N/f]
           "p.scales": s.t().contiguous(),
           "p.g_idx": (torch.arange(K) // G).to(torch.int32)}
    cfg = {"quant_method": "gptq", "bits": bits, "group_size": G, "sym": False, "desc_act": True,
           "checkpoint_format": fmt}
    qw = gptq.reader(cfg, raw.get)("p")
    assert torch.equal(qw.q, q) and torch.equal(qw.dequantize(), want_weight(q, s, z))


def test_gptq_act_order_follows_g_idx_and_an_unbalanced_one_is_refused():
    """w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n] with channels in any group order; a g_idx that
    does not give every group G channels is refused with a clear message."""
    q = random_codes(4, (N, K), 7)
    s = random_scales((K // G, N), 8)
    g_idx = (torch.arange(K).flip(0) // G).to(torch.int32)
    raw = {"p.qweight": torch.from_numpy(hand_pack(q.numpy(), 4)).t().contiguous(),
           "p.qzeros": torch.zeros(K // G, N // 8, dtype=torch.int32), "p.scales": s, "p.g_idx": g_idx}
    read = gptq.reader({"bits": 4, "group_size": G, "desc_act": True}, raw.get)
    z = torch.ones(N, K // G, dtype=torch.int32)                     # `gptq` stores z - 1 (zeros here)
    want = (q.float() - z.float()[:, g_idx.long()]) * s.t().float()[:, g_idx.long()]
    qw = read("p")
    assert qw.perm is not None and torch.allclose(qw.dequantize(), want, rtol=2e-3, atol=0)
    raw["p.g_idx"] = torch.zeros(K, dtype=torch.int32)
    with pytest.raises(UnsupportedModelError, match="act-order layout"):
        read("p")
    with pytest.raises(UnsupportedModelError, match="marlin"):
        gptq.reader({"bits": 4, "checkpoint_format": "marlin"}, raw.get)
    with pytest.raises(UnsupportedModelError, match="3-bit"):
        gptq.reader({"bits": 3}, raw.get)


CT_CONFIG = compressed_tensors.quantization_config(4, G, True, ["lm_head"])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_reader_follows_pack_quantized(bits, symmetric):
    half = 1 << (bits - 1)
    signed = random_codes(bits, (N, K), 9).int() - half                    # values in [-half, half)
    zp = torch.zeros(N, K // G, dtype=torch.int32) if symmetric else random_codes(bits, (N, K // G), 10).int() - half
    s = random_scales((N, K // G), 11).to(torch.bfloat16)                  # bf16 scales, as they are often stored
    raw = {"p.weight_packed": torch.from_numpy(hand_pack((signed + half).numpy().astype(np.uint8), bits)),
           "p.weight_scale": s, "p.weight_shape": torch.tensor([N, K])}
    if not symmetric:
        raw["p.weight_zero_point"] = torch.from_numpy(hand_pack((zp + half).t().numpy().astype(np.uint8), bits)).t()
    qw = compressed_tensors.reader(CT_CONFIG, raw.get)("p")
    assert qw.bits == bits and qw.group_size == G
    w = (signed - zp.repeat_interleave(G, 1)).float() * s.float().repeat_interleave(G, 1)
    assert torch.equal(qw.dequantize(), want_weight(signed + half, s.to(torch.float16), zp + half))
    offset_rounding = float(((zp + half).float() * s.float()).abs().max()) * 2 ** -11    # float16 offsets
    assert torch.allclose(qw.dequantize(), w, rtol=0, atol=offset_rounding)


def test_compressed_tensors_packing_equals_the_libraries_own():
    """Cross-check with compressed-tensors' pack_to_int32 (weights [N, K/f] and zero points [N/f, K/G])."""
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    for bits in (4, 8):
        half = 1 << (bits - 1)
        signed = (random_codes(bits, (N, K), 12).int() - half).to(torch.int8)
        zp = (random_codes(bits, (N, K // G), 13).int() - half).to(torch.int8)
        qw = QuantizedWeight((signed.int() + half).to(torch.uint8), random_scales((N, K // G), 14),
                             torch.zeros(N, K // G, dtype=torch.float16), bits, G)
        qw.offsets = (-(zp.float() + half) * qw.scales.float()).to(torch.float16)
        ours = compressed_tensors.tensors("p", qw, symmetric=False)
        assert torch.equal(ours["p.weight_packed"], ct.pack_to_int32(signed, bits, packed_dim=1))
        assert torch.equal(ours["p.weight_zero_point"], ct.pack_to_int32(zp, bits, packed_dim=0))
        back = ct.unpack_from_int32(ours["p.weight_packed"], bits, torch.Size((N, K)), packed_dim=1)
        assert torch.equal(back, signed)


def test_compressed_tensors_activation_quantization_is_refused():
    cfg = {"quant_method": "compressed-tensors", "format": "int-quantized",
           "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8}}}}
    with pytest.raises(UnsupportedModelError, match="int-quantized"):
        hf_quantized_source(cfg, {}.get)
    with pytest.raises(UnsupportedModelError, match="hqq"):
        hf_quantized_source({"quant_method": "hqq"}, {}.get)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_equal_the_reference_dequantization(type_name):
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    x = np.random.default_rng(1).normal(0, 0.5, (6, 96)).astype(np.float32)
    x[:, :32] += 0.7                                    # an all-positive block (Q4_1's offset is then its min)
    data = gguf.quants.quantize(x, qtype)               # [6, 3 blocks * bytes]
    qw = block_weight(data, int(qtype))
    assert qw is not None and qw.group_size == 32 and qw.bits == (8 if type_name == "Q8_0" else 4)
    ref = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32))
    assert torch.equal(qw.dequantize(), ref)
    assert block_weight(data, int(gguf.GGMLQuantizationType.Q6_K)) is None


def test_quantized_source_serves_dense_names_and_keeps_embeddings_dense():
    qw = QuantizedWeight(random_codes(4, (N, K), 15), random_scales((N, K // G), 16),
                         torch.zeros(N, K // G, dtype=torch.float16), 4, G)
    parts = {"model.layers.0.mlp.up_proj": qw, "model.embed_tokens": qw}
    src = QuantizedSource({"model.norm.weight": torch.ones(3)}.get, lambda raw: parts.get, "test")
    assert torch.equal(src("model.layers.0.mlp.up_proj.weight"), qw.dequantize())
    assert torch.equal(src("model.norm.weight"), torch.ones(3)) and src("model.missing.weight") is None
    assert src.quantized("model.embed_tokens") is None and src.quantized("model.layers.0.mlp.up_proj") is qw


def test_quantized_source_readers_work_on_the_work_device():
    """A reader gets the checkpoint's tensors on `work_device` once it is set (the loader sets a GPU there);
    dense tensors by name stay where the checkpoint reads them."""
    raw = {"p.qweight": torch.zeros(2, 2, dtype=torch.int32), "model.norm.weight": torch.ones(3)}
    seen: list[torch.device] = []

    def make_reader(on_device):
        def read(prefix):
            seen.append(on_device(prefix + ".qweight").device)
            return None
        return read

    src = QuantizedSource(raw.get, make_reader, "test")
    src.quantized("p")
    src.work_device = torch.device("meta")
    src.quantized("p")
    assert seen == [torch.device("cpu"), torch.device("meta")]
    assert src("model.norm.weight").device == torch.device("cpu")


def test_quantization_modes():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not keeps_quantized("auto", cpu) and keeps_quantized("auto", cuda)
    assert keeps_quantized("keep", cpu) and not keeps_quantized("none", cuda)
    assert keeps_quantized("keep", cuda) and not keeps_quantized("none", cpu)
    with pytest.raises(ValueError, match="quantization"):
        keeps_quantized("int4", cpu)


def test_gptq_per_channel_group_minus_one():
    q, z = random_codes(4, (N, K), 17), random_codes(4, (N, 1), 18)
    s = random_scales((N, 1), 19)
    raw = {"p.qweight": torch.from_numpy(hand_pack(q.numpy(), 4)).t().contiguous(),
           "p.qzeros": torch.from_numpy(hand_pack(z.t().numpy(), 4)),
           "p.scales": s.t().contiguous()}
    qw = gptq.reader({"bits": 4, "group_size": -1, "checkpoint_format": "gptq_v2"}, raw.get)("p")
    assert qw.group_size == K and torch.equal(qw.dequantize(), want_weight(q, s, z))


def test_gptq_dynamic_overrides_set_bits_and_group_size_per_module():
    """GPTQ's `dynamic` rules: the first pattern matching a module's name decides its bits and group size
    ("+:" or bare), or leaves it unquantized ("-:", its weight stored dense)."""
    from quant_helpers import gptq_tensors

    from compute_service.engine.quant_formats.gptq import module_overrides

    dynamic = {"-:.*down_proj": {}, "+:.*layers\\.0\\..*v_proj": {"bits": 8, "group_size": 32},
               ".*o_proj": {"bits": 8}}
    assert module_overrides(dynamic, "model.layers.1.mlp.down_proj") is None
    assert module_overrides(dynamic, "model.layers.0.self_attn.v_proj") == {"bits": 8, "group_size": 32}
    assert module_overrides(dynamic, "model.layers.1.self_attn.v_proj") == {}
    gen = torch.Generator().manual_seed(3)
    modules = (("model.layers.0.self_attn.q_proj", 4, 16), ("model.layers.0.self_attn.v_proj", 8, 32),
               ("model.layers.0.self_attn.o_proj", 8, 16))
    raw = {}
    for prefix, bits, group in modules:
        tensors, want = gptq_tensors(torch.randn(32, 64, generator=gen), bits, group, torch.arange(64))
        raw.update({prefix + k: v for k, v in tensors.items()})
        raw[prefix + ".want"] = want
    read = gptq.reader({"bits": 4, "group_size": 16, "dynamic": dynamic}, raw.get)
    for prefix, bits, group in modules:
        qw = read(prefix)
        assert (qw.bits, qw.group_size) == (bits, group) and torch.equal(qw.dequantize(), raw[prefix + ".want"])
    assert read("model.layers.0.mlp.down_proj") is None
    with pytest.raises(UnsupportedModelError, match="3-bit weights .*from `dynamic`"):
        gptq.reader({"bits": 4, "group_size": 16, "dynamic": {".*q_proj": {"bits": 3}}}, raw.get)(
            "model.layers.0.self_attn.q_proj")
