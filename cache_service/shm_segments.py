"""POSIX shared-memory segments owned by the cache service, one per adapter version.

Layout: a 64-byte header (magic, version, task id, weight bytes) then the
weights at offset 64. A client on the same host checks the header before it
trusts the bytes (loraplex.cache_client attaches without the resource tracker,
so a client that exits or crashes never unlinks a segment).

Lifetime: `retire()` unlinks the name at once (no new reader can open it) and
unmaps when the last in-process reader lets go; clients that already mapped it
keep valid bytes, which is how a request that started on an old version
finishes on it. Segments carry the owner's pid in their name, so a restarted
service can remove those of a dead owner (`sweep_dead_owners`); while the
owner runs, multiprocessing's resource tracker also unlinks whatever a crash
leaves behind.
"""
from __future__ import annotations

import ctypes
import os
import re
import secrets
import struct
import threading
from multiprocessing import shared_memory
from pathlib import Path

SEGMENT_PREFIX = "loraplex"
HEADER_BYTES = 64
MAGIC = b"LPXSHM01"
_HEADER = struct.Struct("<8s32sQQ")  # magic, version (ascii, padded), task id, weight bytes
_LIBC = ctypes.CDLL(None, use_errno=True)     # a foreign call releases the GIL while it runs
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_NAME_RE = re.compile(rf"^{SEGMENT_PREFIX}-(\d+)-[0-9a-f]+-")


def new_instance_tag() -> str:
    """`<pid>-<random>`: unique per service process, parsed back by the sweeper."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def pack_header(version: str, task_id: int, num_bytes: int) -> bytes:
    return _HEADER.pack(MAGIC, version.encode("ascii"), task_id, num_bytes)


def unpack_header(raw: bytes) -> tuple[str, int, int]:
    """-> (version, task id, weight bytes); ValueError when it is not a loraplex segment."""
    magic, version, task_id, num_bytes = _HEADER.unpack(raw[:_HEADER.size])
    if magic != MAGIC:
        raise ValueError("not a loraplex adapter segment (bad magic)")
    return version.rstrip(b"\0").decode("ascii"), task_id, num_bytes


class OwnedSegment:
    """A segment this process created: writable weights, pins, retire."""

    def __init__(self, instance: str, num_bytes: int) -> None:
        self.name = f"{SEGMENT_PREFIX}-{instance}-{secrets.token_hex(6)}"
        self.num_bytes = num_bytes
        self._shm = shared_memory.SharedMemory(self.name, create=True, size=HEADER_BYTES + num_bytes)
        self._lock = threading.Lock()
        self._pins = 0
        self._retired = False
        self._closed = False

    @property
    def data(self) -> memoryview:
        """The weight bytes (writable)."""
        buf = self._shm.buf
        assert buf is not None, "segment already closed"
        return buf[HEADER_BYTES:HEADER_BYTES + self.num_bytes]

    def madvise(self, option: int, start: int, length: int) -> None:
        """madvise(2) over bytes [start, start + length) of the mapping (header included; start page-aligned),
        without the GIL: `mmap.madvise` holds it for the whole call, and populating a spare's 4 MiB chunk
        (about 2 ms) then stopped every other thread of the cache (fills, hashes, the event loop)."""
        view = (ctypes.c_char * length).from_buffer(self._shm._mmap, start)  # type: ignore[attr-defined]
        try:
            rc = _LIBC.madvise(ctypes.addressof(view), length, option)     # converted by argtypes
        finally:
            del view            # the mapping can close again
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise({option}): {os.strerror(err)}")

    def use_first(self, num_bytes: int) -> None:
        """Holds `num_bytes` weight bytes from now on, before anyone reads it (a spare made larger): the
        file keeps its size (cutting it while other segments fill stalls them), the header says how much
        is the adapter's, and readers map what the header says."""
        if not 0 < num_bytes <= self.num_bytes:
            raise ValueError(f"a {self.num_bytes}-byte segment cannot hold {num_bytes} bytes")
        self.num_bytes = num_bytes

    def seal(self, version: str, task_id: int) -> None:
        """Writes the header once the bytes are final."""
        buf = self._shm.buf
        assert buf is not None, "segment already closed"
        buf[:_HEADER.size] = pack_header(version, task_id, self.num_bytes)

    def pin(self) -> None:
        with self._lock:
            self._pins += 1

    def unpin(self) -> None:
        with self._lock:
            self._pins -= 1
            close_now = self._retired and self._pins == 0
        if close_now:
            self._close()

    def retire(self) -> None:
        """Unlinks the name now; unmaps once no in-process reader holds it."""
        with self._lock:
            if self._retired:
                return
            self._retired = True
            close_now = self._pins == 0
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        if close_now:
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._shm.close()
        except BufferError:
            # A view is still exported (a reader's chunk); the mapping goes with it.
            pass


def sweep_dead_owners(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlinks loraplex segments whose owning process is gone; returns their names."""
    root = Path(shm_dir)
    if not root.is_dir():
        return []
    removed = []
    for path in root.iterdir():
        m = _NAME_RE.match(path.name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
