"""PEFT factors -> converted rows in one pass, written straight into a buffer the caller owns.

`plan_peft` reads only the folder's config and the safetensors header (the
tensors are views of the mapped file): it checks every factor pair and knows
the converted `config`, row shapes and `[N, W]` size before any value moves.
`PeftRows.fill` then writes each row once: A cast to the storage dtype, then
`B * scale` (the converters' arithmetic: scale in the source dtype, then the
storage cast), with `gate_up_proj`'s two halves of B swapped. Rows are written
by a few threads (numpy releases the GIL; see `row_math`), so a host cache can convert
into its shared-memory segment directly: the file's bytes are read once and
the segment's written once, with no intermediate tensor.

The padding after each row's A and B is left as the buffer holds it: callers
pass zero-filled memory (a fresh shared-memory segment, `torch.zeros`).
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from loraplex.formats import row_math
from loraplex.formats.adapter import Adapter, AdapterMetadata
from loraplex.formats.errors import AdapterFormatError, DtypeError, NonFiniteError
from loraplex.formats.modules import HF_TO_MODULE_ID
from loraplex.formats.peft_config import PeftLoraConfig, read_peft_config
from loraplex.formats.peft_tensors import group_factors, load_state_dict
from loraplex.formats.tensors import STORAGE_DTYPES, storage_dtype

FILL_WORKERS = min(8, os.cpu_count() or 1)
# Bytes of rows per fill thread. Each row's copies and slices take the GIL between them, and more threads
# than the work needs queue on it: on a 16-core host a 57 MB adapter filled in 46 ms on 2 threads and
# 91 ms on 8, a 528 MB one in 200 ms on 4 and 250 ms on 8 (bench/cold_adapter_stages.py).
BYTES_PER_FILL_WORKER = 128 << 20


def fill_workers(num_bytes: int) -> int:
    """Threads for filling `num_bytes` of rows: one per BYTES_PER_FILL_WORKER, at least 2, at most FILL_WORKERS."""
    return min(FILL_WORKERS, max(2, num_bytes // BYTES_PER_FILL_WORKER))


@dataclass(frozen=True)
class _Source:
    """One row's factors: A [r, in], B [out, r] (views of the mapped file) and B's scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    swap_b_halves: bool     # gate_up_proj: the converters put up's half of B first


@dataclass(frozen=True)
class PeftRows:
    """A PEFT adapter's converted rows, planned: config and shapes known, values not yet written."""

    config: np.ndarray                      # int32 [N, 3] rows [module_id, layer_idx, rank]
    in_out: tuple[tuple[int, int], ...]     # per row (in_features, out_features)
    dtype: torch.dtype                      # storage dtype of the rows
    width: int                              # W: the longest row
    metadata: AdapterMetadata
    _sources: tuple[_Source, ...] = field(repr=False, default=())

    @property
    def shape(self) -> tuple[int, int]:
        return len(self._sources), self.width

    @property
    def num_bytes(self) -> int:
        return self.shape[0] * self.width * self.dtype.itemsize

    def fill(self, out: torch.Tensor, *, check_finite: bool = False, workers: int | None = None,
             on_row: Callable[[int], None] | None = None) -> None:
        """Writes every row into `out` [N, W] (zero-filled); `check_finite` refuses NaN/Inf, naming the row.
        `workers` None: `fill_workers` of the rows' bytes. `on_row(i)`: called on the writing thread once
        row i is written (a `RowsHasher` hashes the rows as they are done)."""
        if tuple(out.shape) != self.shape or out.dtype != self.dtype:
            raise ValueError(f"out must be {self.dtype} {list(self.shape)}, got {out.dtype} {list(out.shape)}")
        if workers is None:
            workers = fill_workers(self.num_bytes)
        n = len(self._sources)
        step = max(1, -(-n // max(1, workers)))
        spans = [range(i, min(n, i + step)) for i in range(0, n, step)]

        def run(rows: range) -> list[int]:
            bad = []
            for i in rows:
                if not _write_row(out[i], self._sources[i], check_finite):
                    bad.append(i)
                if on_row is not None:
                    on_row(i)
            return bad

        if len(spans) > 1:
            with ThreadPoolExecutor(len(spans), thread_name_prefix="peft-rows") as pool:
                bad = [i for found in pool.map(run, spans) for i in found]
        else:
            bad = [i for rows in spans for i in run(rows)]
        if bad:
            row = min(bad)
            column = int((~torch.isfinite(out[row])).nonzero()[0, 0])
            raise NonFiniteError(f"{out[row, column].item()} at column {column}", row=row)

    def to_adapter(self) -> Adapter:
        """The rows in a fresh tensor (what `read_peft` returns)."""
        weights = torch.zeros(self.shape, dtype=self.dtype)
        self.fill(weights)
        return Adapter(config=self.config, weights=weights, in_out=self.in_out, metadata=self.metadata)


def _write_row(row: torch.Tensor, src: _Source, check_finite: bool) -> bool:
    """Writes A then scaled B at the start of `row`; False when `check_finite` finds NaN/Inf there."""
    a, b = src.a, src.b
    rank, fin = a.shape
    fout = b.shape[0]
    dst_a = row[: rank * fin].view(rank, fin)
    if a.dtype == row.dtype:
        row_math.copy_into(a, dst_a)
    else:
        dst_a.copy_(a)
    dst = row[rank * fin: rank * (fin + fout)].view(fout, rank)
    half = fout // 2
    parts = ((b[half:], dst[: fout - half]), (b[:half], dst[fout - half:])) if src.swap_b_halves else ((b, dst),)
    for b_part, dst_part in parts:
        if b.dtype == row.dtype:
            row_math.scale_into(b_part, src.scale, dst_part)
        else:   # the converters' order: scale in the factor's dtype, then the storage cast
            dst_part.copy_(b_part * src.scale)
    return not check_finite or row_math.all_finite(row[: rank * (fin + fout)])


def _check_pair(path: str, a: torch.Tensor, b: torch.Tensor, cfg: PeftLoraConfig) -> int:
    """The pair's rank, once its shapes, rank and dtypes are checked."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise AdapterFormatError(f"{path}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                                 "are not [r, in] and [out, r]")
    rank = int(a.shape[0])
    if rank != cfg.rank_for(path):
        raise AdapterFormatError(f"{path}: tensors have rank {rank} but r/rank_pattern give "
                                 f"{cfg.rank_for(path)}")
    for t in (a, b):
        if t.dtype not in STORAGE_DTYPES.values():
            raise DtypeError(f"{path}: LoRA factor dtype {t.dtype} is not float16/bfloat16/float32")
    return rank


def plan_peft(path: str | Path, *, dtype: str | torch.dtype | None = None) -> PeftRows:
    """Plans a PEFT folder's conversion; `dtype` None keeps the factors' own dtype (as llgtrt does)."""
    folder = Path(path)
    cfg = read_peft_config(folder)
    groups = group_factors(load_state_dict(folder), cfg)
    if not groups:
        raise AdapterFormatError(f"{folder}: no LoRA tensors found")
    for e in groups.values():
        if e.a is None or e.b is None:
            raise AdapterFormatError(f"{e.path}: lora_{'B' if e.a is not None else 'A'} is missing")
    all_dtypes = [t.dtype for e in groups.values() for t in (e.a, e.b) if t is not None]
    if dtype is not None:
        target = storage_dtype(dtype)
    else:
        target = all_dtypes[0]
        for d in all_dtypes[1:]:
            target = torch.promote_types(target, d)
        if target not in STORAGE_DTYPES.values():
            raise DtypeError(f"{folder}: LoRA factor dtype {target} is not float16/bfloat16/float32")
    sources, config, in_out = [], [], []
    for (layer, proj), e in groups.items():
        assert e.a is not None and e.b is not None  # checked above
        rank = _check_pair(e.path, e.a, e.b, cfg)
        sources.append(_Source(e.a, e.b, cfg.scale_for(e.path), proj == "gate_up_proj"))
        config.append((HF_TO_MODULE_ID[proj], layer, rank))
        in_out.append((int(e.a.shape[1]), int(e.b.shape[0])))
    width = max(r * (fin + fout) for (_, _, r), (fin, fout) in zip(config, in_out))
    extra = {"r": str(cfg.r), "lora_alpha": str(cfg.lora_alpha), "use_rslora": str(cfg.use_rslora),
             "rank_pattern": json.dumps(cfg.rank_pattern), "alpha_pattern": json.dumps(cfg.alpha_pattern),
             "fan_in_fan_out": str(cfg.fan_in_fan_out), "scale_folded_into_b": "true",
             "base_model_name_or_path": cfg.base_model_name_or_path}
    return PeftRows(config=np.asarray(config, dtype=np.int32).reshape(-1, 3), in_out=tuple(in_out), dtype=target,
                    width=width, metadata=AdapterMetadata(source=str(folder), original_format="peft", extra=extra),
                    _sources=tuple(sources))
