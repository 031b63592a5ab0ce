"""A tensor-parallel rank loading on a GPU unpacks its quantized checkpoint there, as a single-GPU load does
(`loader.unpack_on`): the same quantized shards and whole-model fingerprint as the same rank's load on the
host. One GPU suffices: loading a rank's shards talks to no other rank."""
from __future__ import annotations

import types

import pytest
import torch

from compute_service.engine.model import LAYER_PROJECTIONS
from compute_service.engine.quant_formats.export import quantize_checkpoint
from compute_service.parallel import engine as tp_engine
from tp_helpers import save_tiny_llama

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["awq", "compressed-tensors"])
def test_a_rank_unpacks_its_shards_on_its_gpu(tmp_path, monkeypatch, fmt):
    # groups of 32 (the kernel's smallest: a GPU load keeps smaller ones dense, a host load keeps them quantized);
    # 128 intermediate features so down's 64-feature shard holds whole groups
    dense = save_tiny_llama(tmp_path / "dense", 4, 2, seed=4, intermediate_size=128)
    folder = quantize_checkpoint(dense, tmp_path / "q", fmt=fmt, group_size=32, progress=False).out
    sources, read_model_source = [], tp_engine.read_model_source

    def read_and_keep(p):
        spec, get, template = read_model_source(p)
        sources.append(get)
        return spec, get, template
    monkeypatch.setattr(tp_engine, "read_model_source", read_and_keep)
    for rank in range(2):
        loads = {}
        for device in ("cpu", "cuda"):
            group = types.SimpleNamespace(rank=rank, world_size=2, device=torch.device(device),
                                          all_reduce=None, reduce_add_rms_norm=None)   # loading reduces nothing
            loads[device] = tp_engine.load_sharded(str(folder), group, torch.float32, "keep")[0]
        assert sources[-2].work_device is None and sources[-1].work_device == torch.device("cuda")
        assert loads["cuda"].fingerprint == loads["cpu"].fingerprint
        kept = 0
        for host, gpu in zip(loads["cpu"].model.weights.layers, loads["cuda"].model.weights.layers):
            for name in LAYER_PROJECTIONS:
                a, b = getattr(host, name), getattr(gpu, name)
                assert type(a) is type(b), (rank, name)
                if type(a).__name__ != "QuantLinear":
                    continue
                qa, qb = a.qweight, b.qweight
                assert qb.q.device.type == "cuda" and torch.equal(qa.q, qb.q.cpu()), (rank, name)
                assert torch.equal(qa.scales, qb.scales.cpu()) and torch.equal(qa.offsets, qb.offsets.cpu())
                kept += 1
        assert kept >= len(LAYER_PROJECTIONS), rank       # at least one layer's projections all stayed quantized
