"""Staging: only each row's factors travel, grouped by (module, rank), and every byte arrives in place."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compute_service.adapter_cache.staging import PinnedRing, _Gather, _group_rows, upload
from compute_service.engine.spec import ModelSpec
from compute_helpers import random_adapter

SPEC = ModelSpec(architecture="llama", num_layers=3, hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=12,
                 intermediate_size=80, vocab_size=64, rms_norm_eps=1e-5, rope_theta=1e4,
                 max_position_embeddings=128, tie_word_embeddings=True)


def mixed_adapter(seed: int) -> "object":
    """Rows of several widths and ranks interleaved, so groups are not contiguous in the weights."""
    a, b = random_adapter(SPEC, 4, seed, modules=(1, 5, 7)), random_adapter(SPEC, 9, seed + 1, modules=(2, 6))
    width = max(a.weights.shape[1], b.weights.shape[1])
    rows = [torch.nn.functional.pad(x.weights, (0, width - x.weights.shape[1])) for x in (a, b)]
    order = torch.randperm(a.num_rows + b.num_rows, generator=torch.Generator().manual_seed(seed))
    weights = torch.cat(rows)[order]
    config = np.concatenate([a.config, b.config])[order.numpy()]
    in_out = [(a.in_out + b.in_out)[i] for i in order.tolist()]
    return type(a)(config=config, weights=weights.contiguous(), in_out=tuple(in_out))


def expected_stream(adapter) -> bytes:
    """The factors of every row, group after group, rows in order within a group: what the device receives."""
    out = []
    for _m, r, idx, (fin, fout) in _group_rows(adapter):
        for i in idx:
            out.append(adapter.weights[i, : r * (fin + fout)].contiguous().view(torch.uint8).numpy().tobytes())
    return b"".join(out)


@pytest.mark.parametrize("seed", [0, 1])
def test_gather_windows_reassemble_the_factor_stream(seed):
    adapter = mixed_adapter(seed)
    gather = _Gather(adapter.weights, _group_rows(adapter))
    want = expected_stream(adapter)
    assert gather.num_bytes == len(want) < adapter.num_bytes        # the padding stays behind
    rng = np.random.default_rng(seed)
    cuts = np.unique(np.concatenate(([0, len(want)], rng.integers(0, len(want), 7))))
    got = np.full(len(want), 0xAB, dtype=np.uint8)                    # poisoned: every byte must be written
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        gather.copy_into(got[lo:], int(lo), int(hi))
    assert got.tobytes() == want


def test_cpu_upload_groups_hold_each_rows_factors():
    adapter = mixed_adapter(3)
    up = upload(adapter, 1, torch.device("cpu"), None)
    seen = []
    for g in up.groups:
        fin, fout = g.in_out
        assert g.rows.shape == (len(g.row_ids), g.rank * (fin + fout))
        for j, i in enumerate(g.row_ids.tolist()):
            assert adapter.config[i, 0] == g.module_id and adapter.config[i, 2] == g.rank
            assert torch.equal(g.rows[j], adapter.weights[i, : g.rank * (fin + fout)])
            seen.append(i)
    assert sorted(seen) == list(range(adapter.num_rows))
    assert up.num_bytes == len(expected_stream(adapter))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_cpu_upload_refuses_non_finite_factors(bad):
    adapter = mixed_adapter(4)
    adapter.weights[5, 0] = bad
    with pytest.raises(Exception, match="NaN or Inf"):
        upload(adapter, 1, torch.device("cpu"), None)


@pytest.mark.gpu
@pytest.mark.parametrize("buffer_bytes,threads", [(4096, 3), (1 << 20, 1), (32 << 20, 4)])
def test_ring_upload_lands_every_byte(buffer_bytes, threads):
    adapter = mixed_adapter(5)
    ring = PinnedRing(buffer_bytes, copy_threads=threads)
    stream = torch.cuda.Stream()
    up = upload(adapter, 1, torch.device("cuda"), stream, ring)
    up.event.synchronize()
    assert up.mode == "ring" and bool(up.finite_host)
    for g in up.groups:
        fin, fout = g.in_out
        want = adapter.weights[torch.from_numpy(g.row_ids), : g.rank * (fin + fout)]
        assert torch.equal(g.rows.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_ring_upload_flags_non_finite_factors(bad):
    adapter = mixed_adapter(6)
    adapter.weights[7, 3] = bad
    up = upload(adapter, 1, torch.device("cuda"), torch.cuda.Stream(), PinnedRing(1 << 20, copy_threads=2))
    up.event.synchronize()
    assert not bool(up.finite_host)
