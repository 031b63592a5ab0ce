"""One-pass PEFT conversion into a caller's buffer, and the parallel version hash."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from loraplex.formats import NonFiniteError, read_peft
from loraplex.formats.hashing import CHUNK_BYTES, RowsHasher, weights_version
from loraplex.formats.mapped import mapped_tensors
from loraplex.formats import peft_rows
from loraplex.formats.peft_rows import fill_workers, plan_peft

PROJ = {"q_proj": ("self_attn", 16, 16), "k_proj": ("self_attn", 16, 8), "gate_up_proj": ("mlp", 16, 48)}


def peft_folder(tmp_path, dtype=torch.bfloat16, seed=0, layers=5, rank=4):
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for proj, (block, fin, fout) in PROJ.items():
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=gen).to(dtype)
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=gen).to(dtype)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 3 * rank, "target_modules": list(PROJ)}))
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    return tmp_path, tensors


@pytest.mark.parametrize("workers", [1, 3])
def test_fill_into_a_buffer_equals_read_peft(tmp_path, workers):
    folder, _ = peft_folder(tmp_path)
    rows = plan_peft(folder)
    assert rows.num_bytes == rows.shape[0] * rows.shape[1] * 2
    out = torch.zeros(rows.shape, dtype=rows.dtype)
    rows.fill(out, check_finite=True, workers=workers)
    ref = read_peft(folder)
    assert torch.equal(out.view(torch.int16), ref.weights.view(torch.int16))
    assert (rows.config == ref.config).all() and rows.in_out == ref.in_out


def test_fill_threads_follow_the_adapters_bytes(monkeypatch):
    monkeypatch.setattr(peft_rows, "FILL_WORKERS", 8)
    mib = 1 << 20
    assert [fill_workers(n * mib) for n in (1, 57, 300, 528, 900, 4096)] == [2, 2, 2, 4, 7, 8]
    monkeypatch.setattr(peft_rows, "FILL_WORKERS", 1)      # a one-core machine
    assert fill_workers(528 * mib) == 1


def test_default_fill_equals_read_peft(tmp_path):
    folder, _ = peft_folder(tmp_path)
    rows = plan_peft(folder)
    out = torch.zeros(rows.shape, dtype=rows.dtype)
    rows.fill(out, check_finite=True)
    assert torch.equal(out.view(torch.int16), read_peft(folder).weights.view(torch.int16))


def test_mapped_tensors_are_the_files_tensors(tmp_path):
    folder, tensors = peft_folder(tmp_path, dtype=torch.float16)
    got = mapped_tensors(folder / "adapter_model.safetensors")
    assert list(got) == sorted(tensors)
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("workers", [1, 4])
def test_fill_names_the_first_non_finite_row(tmp_path, workers):
    folder, tensors = peft_folder(tmp_path, dtype=torch.float32)
    keys = sorted(k for k in tensors if k.endswith("lora_B.weight"))
    for k, bad in ((keys[9], float("inf")), (keys[4], float("nan"))):
        tensors[k][1, 2] = bad
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    rows = plan_peft(folder)
    out = torch.zeros(rows.shape, dtype=rows.dtype)
    with pytest.raises(NonFiniteError) as info:
        rows.fill(out, check_finite=True, workers=workers)
    ref = read_peft(folder)
    first = int((~torch.isfinite(ref.weights)).any(dim=1).nonzero()[0, 0])
    assert info.value.row == first


def test_version_does_not_depend_on_threads_and_sees_every_byte():
    gen = np.random.default_rng(0)
    data = gen.integers(0, 255, 3 * CHUNK_BYTES + 12345, dtype=np.uint8)
    config = np.array([[1, 0, 8]], dtype=np.int32)
    v1 = weights_version(torch.bfloat16, config, (1, data.size // 2), data, workers=1)
    assert v1 == weights_version(torch.bfloat16, config, (1, data.size // 2), data, workers=4)
    for where in (0, CHUNK_BYTES, data.size - 1):
        changed = data.copy()
        changed[where] ^= 1
        assert weights_version(torch.bfloat16, config, (1, data.size // 2), changed) != v1
    assert weights_version(torch.float16, config, (1, data.size // 2), data) != v1


def _padded_rows(seed: int, rows: int, row_bytes: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(used bytes per row, rows of random bytes then zero padding [rows, row_bytes], a config for them)."""
    gen = np.random.default_rng(seed)
    used = gen.integers(1, row_bytes, rows).tolist()
    data = np.zeros((rows, row_bytes), dtype=np.uint8)
    for r, u in enumerate(used):
        data[r, :u] = gen.integers(0, 255, u, dtype=np.uint8)
    return used, data, np.array([[1, r, 4] for r in range(rows)], dtype=np.int32)


def test_padding_hashed_as_zeros_gives_the_same_version():
    rows, row_bytes = 9, 3 * CHUNK_BYTES // 4 + 6
    used, data, config = _padded_rows(1, rows, row_bytes)
    full = weights_version(torch.float16, config, (rows, row_bytes // 2), data)
    assert weights_version(torch.float16, config, (rows, row_bytes // 2), data, row_used_bytes=used) == full
    assert weights_version(torch.float16, config, (rows, row_bytes // 2), data, row_used_bytes=used,
                           workers=1) == full


@pytest.mark.parametrize("rows, row_bytes", [(9, 3 * CHUNK_BYTES // 4 + 6), (5, 2 * CHUNK_BYTES + 10), (40, 4096)])
def test_rows_hashed_as_they_are_written_give_the_same_version(rows, row_bytes):
    """Rows written in any order from several threads, chunks spanning rows and rows spanning chunks:
    the version is `weights_version`'s, and it is ready only once every row was written."""
    used, source, config = _padded_rows(2, rows, row_bytes)
    want = weights_version(torch.float16, config, (rows, row_bytes // 2), source)
    data = np.zeros_like(source)
    hasher = RowsHasher(torch.float16, config, (rows, row_bytes // 2), data, used)
    order = np.random.default_rng(3).permutation(rows).tolist()

    def write(part: list[int]) -> None:
        for r in part:
            data[r] = source[r]
            hasher.row_written(r)

    threads = [threading.Thread(target=write, args=(order[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hasher.version() == want

    unfinished = RowsHasher(torch.float16, config, (rows, row_bytes // 2), np.zeros_like(source), used)
    for r in range(rows - 1):
        unfinished.row_written(r)
    with pytest.raises(ValueError, match="not every row"):
        unfinished.version()

