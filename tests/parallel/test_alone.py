"""`parallel.alone.peers_skipped`: a sharded model's forwards on one rank without its peers (the warm-up's
compile pass under tensor parallelism). A whole model "sharded" over one rank is its own sum, so inside the
block it must give the unsharded engine's tokens without touching the group; after it, the group's
collectives are the model's again."""
from __future__ import annotations

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from compute_service.parallel.alone import _local_add_rms_norm, peers_skipped
from tp_helpers import save_tiny_llama


class _GroupNotToCall:
    """A group whose collectives must not run inside `peers_skipped` (its peers are not there)."""

    def __init__(self) -> None:
        self.calls = 0

    def all_reduce(self, t: torch.Tensor) -> None:
        self.calls += 1
        raise AssertionError("all-reduce called while the peers are skipped")

    def reduce_add_rms_norm(self, *args: object) -> None:
        self.calls += 1
        raise AssertionError("all-reduce + norm called while the peers are skipped")


def _engine(folder: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=folder, max_model_len=64, kv_cache_bytes=1 << 20, dtype="float32",
                                  lora_backend="torch"))


def test_a_one_rank_shard_alone_gives_the_unsharded_tokens_and_gets_its_group_back(tmp_path):
    folder = str(save_tiny_llama(tmp_path / "m", 4, 2, seed=11))
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = _engine(folder).generate([[3, 4, 5, 6], [7, 8]], p)
    engine = _engine(folder)
    model = engine.runner.model
    group = _GroupNotToCall()
    model.shard_over(group)
    with peers_skipped(model):
        got = engine.generate([[3, 4, 5, 6], [7, 8]], p)
    assert got == want and group.calls == 0
    assert model.all_reduce == group.all_reduce and model.reduce_add_norm == group.reduce_add_rms_norm
    with pytest.raises(AssertionError, match="all-reduce called"):    # the group's own collectives again
        engine.generate([[3, 4, 5, 6]], p)


def test_the_group_comes_back_after_an_error_and_an_unsharded_model_is_refused(tmp_path):
    engine = _engine(str(save_tiny_llama(tmp_path / "m", 4, 2, seed=11)))
    model = engine.runner.model
    with pytest.raises(ValueError, match="not sharded"):
        with peers_skipped(model):
            pass
    group = _GroupNotToCall()
    model.shard_over(group)
    with pytest.raises(RuntimeError, match="boom"):
        with peers_skipped(model):
            raise RuntimeError("boom")
    assert model.all_reduce == group.all_reduce and model.reduce_add_norm == group.reduce_add_rms_norm


def test_the_local_add_norm_is_the_add_then_the_norm():
    torch.manual_seed(0)
    x, h, w = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64) + 0.5
    out, h_in = torch.empty(3, 64), h.clone()
    _local_add_rms_norm(x, h, w, 1e-5, out, 0)
    s = x.double() + h_in.double()
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(h, (x + h_in))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
