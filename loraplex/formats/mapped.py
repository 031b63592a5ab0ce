"""A safetensors file's tensors as views of one private memory map: nothing is read until used.

The file is first opened with the safetensors library, which checks the header
(offsets inside the file, no overlaps, known dtypes) and gives the tensors'
order; the header is then read again for the byte offsets and every tensor
becomes a `torch.frombuffer` view of a copy-on-write map of the file. A
converter that copies each factor once into its row thus reads the file's
bytes once, instead of once into a tensor and again into the row.

Files this cannot view in place (a dtype outside float16/bfloat16/float32, a
misaligned offset) are read tensor by tensor as before.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from loraplex.formats.errors import AdapterFormatError

_VIEWABLE = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
_ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4}
# Pages are faulted in by the threads that read them (in parallel, 64 KiB at a time with the
# kernel's fault-around) rather than all up front by one thread; the stage benchmark compares both.
POPULATE = False


def _read_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset where the data starts)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def _map(path: Path) -> mmap.mmap | None:
    """A private (copy-on-write) map of the whole file; None for an empty file."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            return None
        flags = mmap.MAP_PRIVATE | (getattr(mmap, "MAP_POPULATE", 0) if POPULATE else 0)
        return mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def mapped_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """name -> tensor in the file's order; views of the mapped file where possible."""
    p = Path(path)
    try:
        with safe_open(str(p), framework="pt") as f:
            keys = list(f.keys())
            header, data_start = _read_header(p)
            views = {k: header[k] for k in keys}
            if not all(v["dtype"] in _VIEWABLE and (data_start + v["data_offsets"][0]) % _ITEMSIZE[v["dtype"]] == 0
                       for v in views.values()):
                return {k: f.get_tensor(k) for k in keys}
    except (SafetensorError, OSError, ValueError, KeyError, struct.error) as e:
        raise AdapterFormatError(f"{p}: not a readable safetensors file ({e})") from e
    mm = _map(p)
    out: dict[str, torch.Tensor] = {}
    for k, v in views.items():
        dtype, shape, begin = _VIEWABLE[v["dtype"]], tuple(v["shape"]), v["data_offsets"][0]
        count = math.prod(shape)
        if count == 0 or mm is None:
            out[k] = torch.empty(shape, dtype=dtype)
            continue
        out[k] = torch.frombuffer(mm, dtype=dtype, count=count, offset=data_start + begin).view(shape)
    return out
