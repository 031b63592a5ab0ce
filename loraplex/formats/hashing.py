"""An adapter's version: a content hash of its config and weight bytes, computed by a few threads.

sha256 over a header (dtype, config shape and bytes, weights shape) followed
by the sha256 digests of the weight bytes in fixed 8 MiB chunks. The chunks
are hashed in parallel (hashlib releases the GIL on large buffers), so a
hundreds-of-megabytes adapter costs a fraction of one core's sha256 pass; the
chunk size is fixed, so the version does not depend on the thread count or
the machine. Every service computes it with this one function.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

CHUNK_BYTES = 8 << 20
HASH_WORKERS = min(8, os.cpu_count() or 1)


def _digest(chunk: memoryview) -> bytes:
    return hashlib.sha256(chunk).digest()


def weights_version(dtype: Any, config: np.ndarray, shape: tuple[int, ...], data: Any,
                    workers: int = HASH_WORKERS) -> str:
    """First 16 hex digits of the hash of (`dtype`, `config`, `shape`, the bytes of `data`)."""
    h = hashlib.sha256(b"loraplex-rows-v2\0")
    h.update(str(dtype).encode())
    h.update(np.asarray(config.shape, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(config, dtype=np.int32).tobytes())
    h.update(np.asarray(shape, dtype=np.int64).tobytes())
    flat = memoryview(data).cast("B")
    chunks = [flat[i: i + CHUNK_BYTES] for i in range(0, len(flat), CHUNK_BYTES)]
    if len(chunks) > 1 and workers > 1:
        with ThreadPoolExecutor(min(workers, len(chunks)), thread_name_prefix="hash") as pool:
            digests = list(pool.map(_digest, chunks))
    else:
        digests = [_digest(c) for c in chunks]
    for d in digests:
        h.update(d)
    for c in chunks:
        c.release()
    flat.release()
    return h.hexdigest()[:16]
