"""GGUF Q4_0 / Q4_1 / Q8_0 tensors load through the canonical form (torch) with the same float32 values, in
the same shape, as the gguf package's dequantization, which the loader used before: bit for bit, except
that a zero may come out +0.0 where the package gives -0.0 (d * 0 with d < 0; as values they are equal)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compute_service.engine.quant_formats.gguf import EXACT_TYPES, K_TYPES, KEPT_TYPES, block_weight
from quant_helpers import random_blocks


@pytest.mark.parametrize("tensor_type", sorted(K_TYPES))
def test_k_quants_in_the_canonical_form_equal_the_gguf_package_to_float16_scales(tensor_type):
    """Q4_K / Q5_K: groups of 32 whose scale and offset are the sub-block's d sc and -dmin m rounded to
    float16 once; every weight within that rounding of the package's (relative 2^-11 of |d sc q| + |dmin m|).
    A wrong nibble, fifth bit or 6-bit scale field would be off by whole code steps."""
    from gguf import GGMLQuantizationType, dequantize

    data = random_blocks(tensor_type, rows=19, blocks=3, seed=tensor_type)
    want = np.asarray(dequantize(data, GGMLQuantizationType(tensor_type)), dtype=np.float32)
    qw = block_weight(data, tensor_type)
    assert qw.group_size == 32 and qw.bits == KEPT_TYPES[tensor_type][2] and qw.shape == want.shape == (19, 768)
    assert int(qw.q.max()) == (31 if tensor_type == 13 else 15)
    got = qw.dequantize(torch.float32).numpy()
    bound = (np.abs(qw.scales.float().numpy()).repeat(32, 1) * 31 + np.abs(qw.offsets.float().numpy()).repeat(32, 1))
    assert (np.abs(got - want) <= bound * 2.0 ** -10).all()
    assert block_weight(data, tensor_type, exact_only=True) is None


@pytest.mark.parametrize("tensor_type", sorted(EXACT_TYPES))
def test_canonical_dequantization_equals_the_gguf_package(tensor_type):
    from gguf import GGMLQuantizationType, dequantize

    data = random_blocks(tensor_type, rows=37, blocks=6, seed=tensor_type)
    want = np.asarray(dequantize(data, GGMLQuantizationType(tensor_type)), dtype=np.float32)
    got = block_weight(data, tensor_type).dequantize(torch.float32).numpy()
    assert got.shape == want.shape == (37, 6 * 32)
    assert np.array_equal(got, want) and not np.isnan(got).any()
    differs = got.view(np.uint32) != want.view(np.uint32)
    assert (got[differs] == 0).all()                     # only the sign of some zeros


@pytest.mark.slow
def test_default_model_loads_the_same_weights_as_the_gguf_package():
    from gguf import GGUFReader, dequantize

    from compute_service.engine.gguf_loader import read_gguf
    from compute_service.engine.loader import default_model_path

    try:
        path = default_model_path()
    except Exception:  # noqa: BLE001 - the default model is an optional install
        pytest.skip("the default SmolLM2 GGUF is not installed")
    _, source, _ = read_gguf(path)
    by_name = {t.name: t for t in GGUFReader(str(path)).tensors}
    checked = 0
    for hf_name, t in source._by_hf.items():           # noqa: SLF001 - every tensor the loader can return
        if int(t.tensor_type) not in EXACT_TYPES:
            continue
        want = np.asarray(dequantize(by_name[t.name].data, by_name[t.name].tensor_type), dtype=np.float32)
        heads = source._heads(hf_name)                  # noqa: SLF001
        if heads is not None:
            from compute_service.engine.gguf_loader import _unpermute
            want = _unpermute(want, heads)
        got = source(hf_name).numpy()
        assert got.shape == want.shape and np.array_equal(got, want), hf_name
        checked += 1
    assert checked > 200


@pytest.mark.gpu
def test_dequantizing_on_the_gpu_gives_the_host_s_bits(tiny_models, tmp_path):
    """A GPU load dequantizes block types there (`work_device`): every tensor, q/k rows un-interleaved, equal
    bit for bit to the host's."""
    from compute_service.engine.gguf_loader import read_gguf
    from quant_helpers import GGUF_TYPES, write_tiny_gguf

    _, source, _ = read_gguf(write_tiny_gguf(tiny_models["llama_tied"][0], tmp_path / "tiny.gguf", GGUF_TYPES))
    names = [n for n, t in source._by_hf.items() if int(t.tensor_type) in EXACT_TYPES]   # noqa: SLF001
    host = {n: source(n) for n in names}
    source.work_device = torch.device("cuda")
    assert any(source._heads(n) for n in names)                                       # noqa: SLF001
    for n in names:
        got = source(n)
        assert got.device.type == "cuda" and got.is_contiguous() and got.dtype == torch.float32
        assert torch.equal(got.cpu().view(torch.int32), host[n].view(torch.int32)), n
