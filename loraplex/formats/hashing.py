"""An adapter's version: a content hash of its config and weight bytes, computed by a few threads.

sha256 over a header (dtype, config shape and bytes, weights shape) followed
by the sha256 digests of the weight bytes in fixed 8 MiB chunks. The chunks
are hashed in parallel (hashlib releases the GIL on large buffers), so a
hundreds-of-megabytes adapter costs a fraction of one core's sha256 pass; the
chunk size is fixed, so the version does not depend on the thread count or
the machine. Every service computes it with this one function.

A caller that knows each row's padding is zero without looking (a converter
that wrote only the factors into zero-filled shared memory) passes the used
bytes per row: the padding is then hashed from a zero buffer instead of being
read, so its never-touched pages are never faulted in. The digest is the same.
"""
from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

CHUNK_BYTES = 8 << 20
HASH_WORKERS = min(8, os.cpu_count() or 1)
_ZEROS = bytes(1 << 20)


def _digest(flat: memoryview, begin: int, end: int, row_bytes: int, used: Sequence[int] | None) -> bytes:
    """sha256 of flat[begin:end], reading only each row's first `used[r]` bytes when `used` is given."""
    if used is None:
        return hashlib.sha256(flat[begin:end]).digest()
    h = hashlib.sha256()
    for row in range(begin // row_bytes, -(-end // row_bytes)):
        start = row * row_bytes
        data_end = start + used[row]
        a, b = max(begin, start), min(end, data_end)
        if a < b:
            h.update(flat[a:b])
        a, b = max(begin, data_end), min(end, start + row_bytes)
        while a < b:
            n = min(b - a, len(_ZEROS))
            h.update(_ZEROS[:n])
            a += n
    return h.digest()


def _head(dtype: Any, config: np.ndarray, shape: tuple[int, ...]) -> Any:
    h = hashlib.sha256(b"loraplex-rows-v2\0")
    h.update(str(dtype).encode())
    h.update(np.asarray(config.shape, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(config, dtype=np.int32).tobytes())
    h.update(np.asarray(shape, dtype=np.int64).tobytes())
    return h


def _spans(total: int) -> list[tuple[int, int]]:
    return [(i, min(total, i + CHUNK_BYTES)) for i in range(0, total, CHUNK_BYTES)]


def _version(head: Any, digests: Sequence[bytes]) -> str:
    for d in digests:
        head.update(d)
    return head.hexdigest()[:16]


def weights_version(dtype: Any, config: np.ndarray, shape: tuple[int, ...], data: Any,
                    workers: int = HASH_WORKERS, row_used_bytes: Sequence[int] | None = None) -> str:
    """First 16 hex digits of the hash of (`dtype`, `config`, `shape`, the bytes of `data`).

    `row_used_bytes`: per row of `shape[0]` rows, how many leading bytes may be non-zero; the rest
    of each row must be zero and is not read.
    """
    h = _head(dtype, config, shape)
    flat = memoryview(data).cast("B")
    total = len(flat)
    row_bytes = total // max(1, int(shape[0])) if row_used_bytes is not None else 0
    spans = _spans(total)
    if len(spans) > 1 and workers > 1:
        with ThreadPoolExecutor(min(workers, len(spans)), thread_name_prefix="hash") as pool:
            digests = list(pool.map(lambda s: _digest(flat, s[0], s[1], row_bytes, row_used_bytes), spans))
    else:
        digests = [_digest(flat, a, b, row_bytes, row_used_bytes) for a, b in spans]
    flat.release()
    return _version(h, digests)


class RowsHasher:
    """`weights_version(..., row_used_bytes=...)` of rows being written, in any order and from any thread:
    each fixed chunk is hashed (on up to `workers` threads) as soon as every row it covers is written
    (`row_written`), so the hashing overlaps the writing instead of following it; `version()` waits for
    the last chunk. The same digest as `weights_version` over the finished bytes."""

    def __init__(self, dtype: Any, config: np.ndarray, shape: tuple[int, ...], data: Any,
                 row_used_bytes: Sequence[int], workers: int = HASH_WORKERS) -> None:
        self._head = _head(dtype, config, shape)
        self._flat = memoryview(data).cast("B")
        total, rows = len(self._flat), max(1, int(shape[0]))
        self._row_bytes = total // rows
        self._used = row_used_bytes
        self._spans = _spans(total)
        rb = max(1, self._row_bytes)
        # Each chunk waits for the rows it overlaps; each row knows its chunks.
        self._waiting = [(b - 1) // rb - a // rb + 1 for a, b in self._spans]
        self._digests: list[Future[bytes] | None] = [None] * len(self._spans)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, min(workers, len(self._spans))), thread_name_prefix="hash")

    def row_written(self, row: int) -> None:
        start = row * self._row_bytes
        first, last = start // CHUNK_BYTES, (start + max(1, self._row_bytes) - 1) // CHUNK_BYTES
        ready = []
        with self._lock:
            for k in range(first, min(last, len(self._spans) - 1) + 1):
                self._waiting[k] -= 1
                if self._waiting[k] == 0:
                    ready.append(k)
        for k in ready:
            a, b = self._spans[k]
            self._digests[k] = self._pool.submit(_digest, self._flat, a, b, self._row_bytes, self._used)

    def version(self) -> str:
        """The version, once every row was written (ValueError when some were not)."""
        try:
            if any(f is None for f in self._digests):
                raise ValueError("not every row was written")
            return _version(self._head, [f.result() for f in self._digests if f is not None])
        finally:
            self.close()

    def close(self) -> None:
        """Stops hashing (after the chunks already started) and lets go of the buffer."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._flat.release()
