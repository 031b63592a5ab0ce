"""A GGUF file's metadata and tensor table, read without building the tokenizer's arrays.

Every service needs the model's shapes (`ModelSpec.from_gguf`: the gateway and
the cache at start-up) and the compute service its tensors, none the
vocabulary: a general-purpose reader that turns every one of SmolLM2's 98k
token and merge strings into array views spends about 3 s of start-up on it.
Here string arrays are stepped over (only their lengths are kept), other
values are read with `struct`, and each tensor is a view of the memory-mapped
file shaped as `gguf.dequantize` expects (raw bytes per row for quantized types).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = 0x46554747          # "GGUF", little-endian
STRING, ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_PLAIN_TENSORS = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
                  28: np.float64}


@dataclass
class TensorInfo:
    name: str
    tensor_type: Any              # gguf.GGMLQuantizationType
    data: np.ndarray              # view of the file: values, or bytes per row for quantized types


@dataclass
class GGUFHeader:
    fields: dict[str, Any]                                       # key -> value (str, number, list)
    array_lengths: dict[str, int] = field(default_factory=dict)  # string arrays stepped over: key -> length
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.off = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.off)[0]
        self.off += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        s = bytes(self.buf[self.off: self.off + n]).decode("utf-8")
        self.off += n
        return s

    def skip_strings(self, count: int) -> None:
        off, buf = self.off, self.buf
        for _ in range(count):
            off += 8 + struct.unpack_from("<Q", buf, off)[0]
        self.off = off

    def value(self, vtype: int, key: str, header: GGUFHeader) -> Any:
        if vtype == STRING:
            return self.string()
        if vtype != ARRAY:
            return self.unpack(_SCALARS[vtype])
        itype, count = self.unpack("I"), self.unpack("Q")
        if itype == STRING:
            if count > 256:                   # a vocabulary or merge list: its length is all we keep
                header.array_lengths[key] = count
                self.skip_strings(count)
                return None
            return [self.string() for _ in range(count)]
        if itype == ARRAY:
            return [self.value(ARRAY, key, header) for _ in range(count)]
        arr = np.frombuffer(self.buf, dtype=np.dtype(_NUMPY[itype]).newbyteorder("<"), count=count,
                            offset=self.off)
        self.off += arr.nbytes
        return arr.tolist()


def read_header(path: Path) -> GGUFHeader:
    """Metadata (string arrays longer than 256 entries reduced to their lengths) and tensor views."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    if cur.unpack("I") != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (bad magic)")
    version = cur.unpack("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    num_tensors, num_kv = cur.unpack("Q"), cur.unpack("Q")
    header = GGUFHeader({})
    for _ in range(num_kv):
        key = cur.string()
        value = cur.value(cur.unpack("I"), key, header)
        if value is not None:
            header.fields[key] = value
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = [cur.unpack("Q") for _ in range(cur.unpack("I"))]
        infos.append((name, dims, cur.unpack("I"), cur.unpack("Q")))
    align = int(header.fields.get("general.alignment", 32))
    start = -(-cur.off // align) * align
    data = np.memmap(path, mode="r")
    for name, dims, raw_type, offset in infos:
        qtype = GGMLQuantizationType(raw_type)
        n_elems = int(np.prod(dims))
        shape = tuple(reversed(dims))
        if raw_type in _PLAIN_TENSORS:
            dtype: Any = _PLAIN_TENSORS[raw_type]
            count = n_elems
        else:
            block, type_size = GGML_QUANT_SIZES[qtype]
            dtype, count = np.uint8, n_elems * type_size // block
            shape = quant_shape_to_byte_shape(shape, qtype)
        arr = np.frombuffer(data, dtype=dtype, count=count, offset=start + offset).reshape(shape)
        header.tensors[name] = TensorInfo(name, qtype, arr)
    return header
