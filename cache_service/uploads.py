"""One adapter upload: header checks, bytes into the backend's buffer, validation, hashing.

The bytes land in the backend's writer (for shm, the segment that will be
published, so a put costs one copy); the adapter is validated in place
against the base model and hashed before `HostCache` commits it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex.errors import (FailedPreconditionError, InvalidArgumentError, LoraplexError,
                             ResourceExhaustedError)
from loraplex.formats import (AdapterError, AdapterMetadata, AdapterTooLargeError, BaseModelMismatchError,
                              ModelSpec, STORAGE_DTYPES, validate)
from loraplex.formats.adapter import Adapter
from loraplex.formats.hashing import RowsHasher, weights_version
from loraplex.formats.peft_rows import PeftRows
from cache_service.backend import CacheBackend, Writer
from cache_service.records import AdapterRecord


@dataclass(frozen=True)
class UploadClaim:
    """What an upload's header says, before any byte is trusted."""

    task_id: int
    config: np.ndarray              # int32 [N, 3]
    dtype: str                      # "float16" | "bfloat16" | "float32"
    shape: tuple[int, ...]          # [N, W]
    num_bytes: int
    version: str = ""               # claimed content hash ("" = none)
    fingerprint: str = ""           # base model the sender validated against ("" = none)
    source: str = "inline"
    name: str = ""
    original_format: str = "inline"
    extra: dict[str, str] = field(default_factory=dict)


def map_adapter_error(exc: AdapterError, where: str = "") -> LoraplexError:
    """An adapter error from the formats package -> the status a client gets."""
    prefix = f"{where}: " if where else ""
    if isinstance(exc, AdapterTooLargeError):
        return ResourceExhaustedError(prefix + str(exc))
    if isinstance(exc, BaseModelMismatchError):
        return FailedPreconditionError(prefix + str(exc))
    return InvalidArgumentError(prefix + str(exc))


def check_claim(claim: UploadClaim, fingerprint: str) -> torch.dtype:
    """Header-level checks; returns the torch dtype."""
    if claim.dtype not in STORAGE_DTYPES:
        raise InvalidArgumentError(f"weights dtype must be one of {sorted(STORAGE_DTYPES)}, got {claim.dtype!r}")
    dtype = STORAGE_DTYPES[claim.dtype]
    if claim.config.ndim != 2 or claim.config.shape[1] != 3:
        raise InvalidArgumentError(f"config must be int32 [N, 3], got shape {list(claim.config.shape)}")
    if len(claim.shape) != 2 or claim.shape[0] != claim.config.shape[0] or min(claim.shape) < 1:
        raise InvalidArgumentError(f"weights shape {list(claim.shape)} must be [N, W] with N = "
                                   f"{claim.config.shape[0]} config rows and W >= 1")
    expected = math.prod(claim.shape) * dtype.itemsize
    if claim.num_bytes != expected:
        raise InvalidArgumentError(f"weights_num_bytes is {claim.num_bytes} but shape {list(claim.shape)} "
                                   f"of {claim.dtype} is {expected} bytes")
    if claim.fingerprint and claim.fingerprint != fingerprint:
        raise FailedPreconditionError(f"adapter was validated for base model {claim.fingerprint}, "
                                      f"this cache serves {fingerprint}")
    return dtype


class Upload:
    """Receives one adapter's bytes in order, then yields a validated record."""

    def __init__(self, backend: CacheBackend, claim: UploadClaim, spec: ModelSpec, fingerprint: str,
                 max_lora_rank: int) -> None:
        self.dtype = check_claim(claim, fingerprint)
        self.claim = claim
        self._spec = spec
        self._fingerprint = fingerprint
        self._max_lora_rank = max_lora_rank
        self.writer: Writer = backend.open_writer(claim.num_bytes)
        self.received = 0
        self.values_checked = False     # set by a converter that wrote and checked every row itself
        self.filled_version = ""        # set by a converter that hashed the bytes it wrote
        self.converted_by = ""          # "worker" or "service": where a converter wrote the rows
        self.started = time.perf_counter()

    def weights_view(self) -> torch.Tensor:
        """The writer's buffer as the `[N, W]` weights tensor, for a converter that fills it in place."""
        return torch.frombuffer(self.writer.buffer, dtype=self.dtype,
                                count=math.prod(self.claim.shape)).view(*self.claim.shape)

    def mark_filled(self, values_checked: bool, version: str) -> None:
        """Every byte was written through `weights_view` or into the writer's shared memory (and, if
        `values_checked`, found finite; `version`: their version, hashed by the writer as it wrote them,
        `fill_rows_hashed`)."""
        self.received = self.claim.num_bytes
        self.values_checked = values_checked
        self.filled_version = version

    def write(self, chunk: bytes | memoryview) -> None:
        end = self.received + len(chunk)
        if end > self.claim.num_bytes:
            raise InvalidArgumentError(f"received more than the {self.claim.num_bytes} weight bytes "
                                       "the header announced")
        self.writer.buffer[self.received:end] = chunk
        self.received = end

    def finish(self) -> AdapterRecord:
        """Checks completeness, validates in place, hashes; the record to commit."""
        c = self.claim
        if self.received != c.num_bytes:
            raise InvalidArgumentError(f"stream ended after {self.received} of {c.num_bytes} weight bytes")
        buffer = self.writer.buffer
        weights = torch.frombuffer(buffer, dtype=self.dtype, count=math.prod(c.shape)).view(*c.shape)
        meta = AdapterMetadata(source=c.source, original_format=c.original_format, extra=dict(c.extra))
        try:
            checked = validate(Adapter(config=c.config, weights=weights, metadata=meta), self._spec,
                               self._max_lora_rank, fingerprint=self._fingerprint,
                               check_values=not self.values_checked)
        except AdapterError as exc:
            raise map_adapter_error(exc, f"task id {c.task_id}") from exc
        in_out = checked.in_out
        del checked, weights
        version = self.filled_version or weights_version(self.dtype, c.config, c.shape, buffer)
        try:
            buffer.release()
        except BufferError:
            pass  # a view is still referenced somewhere; it is released with it
        if c.version and c.version != version:
            raise InvalidArgumentError(f"task id {c.task_id}: the bytes hash to version {version}, "
                                       f"the header says {c.version} (corrupted transfer?)")
        return AdapterRecord(
            task_id=c.task_id, version=version, config=tuple((int(r[0]), int(r[1]), int(r[2])) for r in c.config),
            dtype=c.dtype, shape=(int(c.shape[0]), int(c.shape[1])), num_bytes=c.num_bytes,
            fingerprint=self._fingerprint, source=c.source, name=c.name, original_format=c.original_format,
            extra=dict(c.extra), in_out=tuple((int(a), int(b)) for a, b in in_out), stored_unix_s=time.time())

    def abort(self) -> None:
        self.writer.abort()


def fill_rows_hashed(rows: PeftRows, weights: torch.Tensor, data) -> str:
    """Writes `rows` into `weights` (zero-filled; a view of `data`), refusing NaN/Inf (AdapterError), and
    returns their version, the digest `weights_version` gives the finished bytes: each chunk of `data` is
    hashed as soon as the rows it holds are written, so the hash runs beside the fill instead of after it,
    and each row's padding is hashed as zeros, never read (its pages are never faulted in). 2-core machine,
    never-seen rank-64 SmolLM2 adapters through `bench/cold_adapter.py`: resolve median 79 / 79 ms before,
    66 / 75 ms after."""
    used = [int(r) * (fin + fout) * rows.dtype.itemsize for r, (fin, fout) in zip(rows.config[:, 2], rows.in_out)]
    hasher = RowsHasher(rows.dtype, rows.config, rows.shape, data, used)
    try:
        rows.fill(weights, check_finite=True, on_row=hasher.row_written)
    except BaseException:
        hasher.close()
        raise
    return hasher.version()


def claim_for(adapter: Adapter, task_id: int, *, name: str = "") -> UploadClaim:
    """The claim of an adapter already in memory (loaded from disk)."""
    dtype = str(adapter.weights.dtype).removeprefix("torch.")
    return UploadClaim(task_id=task_id, config=adapter.config, dtype=dtype,
                       shape=tuple(adapter.weights.shape), num_bytes=adapter.num_bytes,
                       fingerprint=adapter.metadata.fingerprint, source=adapter.metadata.source,
                       name=name, original_format=adapter.metadata.original_format or "inline",
                       extra=dict(adapter.metadata.extra))


def weight_bytes(adapter: Adapter) -> memoryview:
    """The adapter's weights as flat bytes, without a copy when already contiguous."""
    return adapter.weights.contiguous().reshape(-1).view(torch.uint8).numpy().data


