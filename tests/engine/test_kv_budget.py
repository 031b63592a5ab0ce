"""The KV cache's share of GPU memory leaves room for a fixed-size adapter pool allocated after it.

On an 80 GB GPU, the KV cache took 0.85 of the free memory and an 8 GiB pool came on top, so graph
capture ran out of memory at start-up. Runs on the CPU: the free-memory query is replaced.
"""
from __future__ import annotations

import pytest
import torch

from compute_service.build import engine_config
from compute_service.config import ComputeConfig
from compute_service.engine.errors import CapacityError
from compute_service.engine.kv_cache import cuda_kv_budget

GIB = 1 << 30


@pytest.fixture
def free_78_gib(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (78 * GIB, 80 * GIB))


def test_fixed_pool_comes_out_of_the_kv_share(free_78_gib):
    share = int(78 * GIB * 0.85)
    assert cuda_kv_budget(torch.device("cuda"), 0.85) == share
    assert cuda_kv_budget(torch.device("cuda"), 0.85, 8 * GIB) == share - 8 * GIB


def test_pool_larger_than_the_share_is_refused_with_the_sizes(free_78_gib):
    with pytest.raises(CapacityError, match=r"70.00 GiB adapter pool.*lower the adapter pool size"):
        cuda_kv_budget(torch.device("cuda"), 0.85, 70 * GIB)


def test_service_reserves_its_fixed_pool_on_cuda_only():
    config = ComputeConfig(lora_gpu_cache_bytes=8 * GIB)
    assert engine_config(config, torch.device("cuda")).kv_reserve_bytes == 8 * GIB
    assert engine_config(config, torch.device("cpu")).kv_reserve_bytes == 0
    # A pool sized as a fraction is sized from what the KV cache leaves: nothing to reserve.
    assert engine_config(ComputeConfig(), torch.device("cuda")).kv_reserve_bytes == 0
