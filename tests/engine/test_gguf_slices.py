"""GGUF slices read from the file (`GGUFSource.rows` / `columns`): the same values as the whole tensor
dequantized and then cut, reading only the slice's rows or blocks where the cut allows; and a
tensor-parallel rank's source over them equals the same source cut from whole tensors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from compute_service.engine.gguf_loader import GGUFSource, read_gguf
from compute_service.parallel.shard import shard_for, sharded_source
from quant_helpers import GGUF_TYPES, write_tiny_gguf

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture
def gguf_source(tiny_models, tmp_path):
    model, _ = tiny_models["llama_tied"]
    spec, source, _ = read_gguf(write_tiny_gguf(model, tmp_path / "tiny.gguf", GGUF_TYPES))
    return spec, source


@pytest.fixture
def dequantized_rows(monkeypatch):
    """The row and byte/value counts of every array `GGUFSource` dequantizes."""
    seen: list[tuple[int, ...]] = []
    real = GGUFSource._dense

    def spy(self, data: np.ndarray, tensor_type, heads):
        seen.append(tuple(data.shape))
        return real(self, data, tensor_type, heads)

    monkeypatch.setattr(GGUFSource, "_dense", spy)
    return seen


def test_rows_equal_the_whole_tensor_cut(gguf_source, dequantized_rows):
    spec, source = gguf_source
    d = spec.head_dim
    for layer in range(spec.num_layers):
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.{proj}.weight"
            whole = source(name)
            n = whole.shape[0]
            aligned = (d, 3 * d) if "q_proj" in proj else (d, 2 * d) if "k_proj" in proj else (5, n - 3)
            for a, b in (aligned, (3, 17)):
                dequantized_rows.clear()
                got = source.rows(name, a, b)
                assert torch.equal(got, whole[a:b]), (name, a, b)
                if (a, b) == aligned or proj not in ("self_attn.q_proj", "self_attn.k_proj"):
                    assert [s[0] for s in dequantized_rows] == [b - a], (name, a, b, dequantized_rows)


def test_columns_equal_the_whole_tensor_cut(gguf_source, dequantized_rows):
    spec, source = gguf_source
    for layer in range(spec.num_layers):
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.{proj}.weight"
            whole = source(name)
            k = whole.shape[1]
            for a, b in ((32, 64), (0, 32), (8, 40)):
                if b > k:
                    continue
                dequantized_rows.clear()
                got = source.columns(name, a, b)
                assert torch.equal(got, whole[:, a:b]), (name, a, b)
                kind = GGUF_TYPES.get(f"{layer}.{proj}")
                if kind is None:                                       # plain values: only the slice's
                    assert dequantized_rows == [(whole.shape[0], b - a)], (name, a, b, dequantized_rows)
                elif a % 32 == 0 and b % 32 == 0:                      # only the slice's blocks
                    block, nbytes = GGML_QUANT_SIZES[getattr(GGMLQuantizationType, kind)]
                    want = (whole.shape[0], (b - a) // block * nbytes)
                    assert dequantized_rows == [want], (name, a, b, dequantized_rows)


def test_quantized_slices_equal_the_whole_weight_cut(gguf_source, monkeypatch):
    from compute_service.engine.quant_formats import gguf as gguf_blocks

    spec, source = gguf_source
    shapes: list[tuple[int, ...]] = []
    real = gguf_blocks.block_weight

    def spy(data, tensor_type):
        shapes.append(tuple(data.shape))
        return real(data, tensor_type)

    def same(x, y) -> bool:
        return (x.bits, x.group_size) == (y.bits, y.group_size) and all(
            torch.equal(u, v) for u, v in ((x.q, y.q), (x.scales, y.scales), (x.offsets, y.offsets)))

    d = spec.head_dim
    for key, kind in GGUF_TYPES.items():
        layer, proj = key.split(".", 1)
        prefix = f"model.layers.{layer}.{proj}"
        whole = source.quantized(prefix)
        n, k = whole.shape
        a, b = (d, 2 * d) if proj.endswith(("q_proj", "k_proj")) else (5, n - 3)
        monkeypatch.setattr(gguf_blocks, "block_weight", spy)
        shapes.clear()
        assert same(source.quantized_rows(prefix, a, b), whole.rows(a, b)), key
        assert [s[0] for s in shapes] == [b - a], (key, shapes)         # only those rows were read
        shapes.clear()
        got = source.quantized_columns(prefix, 32, 64)
        want = whole.q[:, 32:64], whole.scales[:, 1:2], whole.offsets[:, 1:2]
        assert all(torch.equal(u, v) for u, v in zip((got.q, got.scales, got.offsets), want)), key
        block, nbytes = GGML_QUANT_SIZES[getattr(GGMLQuantizationType, kind)]
        assert shapes == [(n, 32 // block * nbytes)], (key, shapes)      # one block of every row
        assert source.quantized_columns(prefix, 16, 48) is None          # not on the block: read dense
        monkeypatch.setattr(gguf_blocks, "block_weight", real)
    assert source.quantized_rows("model.layers.0.mlp.down_proj", 0, 8) is None     # stored F32


def test_missing_names_give_none(gguf_source):
    _, source = gguf_source
    assert source.rows("model.layers.9.mlp.up_proj.weight", 0, 4) is None
    assert source.columns("model.layers.9.mlp.down_proj.weight", 0, 4) is None


@pytest.mark.parametrize("tp", [2, 4])
def test_a_rank_reads_the_same_slices_as_from_whole_tensors(gguf_source, tp):
    """tp = 4 over 2 KV heads replicates each KV head on two ranks."""
    spec, source = gguf_source

    def whole(name: str) -> torch.Tensor | None:     # no rows / columns: read whole, then cut
        return source(name)

    whole.quantized = source.quantized          # kept quantized, but no slice readers
    for rank in range(tp):
        shard = shard_for(spec, tp, rank)
        from_file, from_whole = sharded_source(spec, shard, source), sharded_source(spec, shard, whole)
        for layer in range(spec.num_layers):
            for proj in PROJECTIONS:
                name = f"model.layers.{layer}.{proj}.weight"
                assert torch.equal(from_file(name), from_whole(name)), (tp, rank, name)
                x, y = from_file.quantized(name[:-7]), from_whole.quantized(name[:-7])
                assert (x is None) == (y is None), (tp, rank, name)
                if x is not None:
                    assert all(torch.equal(u, v) for u, v in ((x.q, y.q), (x.scales, y.scales),
                                                              (x.offsets, y.offsets))), (tp, rank, name)
