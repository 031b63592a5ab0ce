"""Warming the L2 with weights that a later launch of the step reads (Hopper's bulk prefetch to L2).

A decode step of a few tokens is a chain of launches that take turns on the memory: the projections stream their
weights while the norms, RoPE + cache, attention and the SwiGLU read little and leave DRAM idle, and a projection
reaches its full read rate only once its programs' first loads are in flight. `l2_prefetch`, launched on a side
stream at such a point (`compute_service.engine.l2_prefetch`), asks the memory system to bring byte ranges of a
later projection's weights into the L2 (50 MB on an H100 / H200): one `cp.async.bulk.prefetch.L2` instruction a
chunk, which no thread waits for. The projection's loads of those bytes then hit the L2.

A hint only: it moves nothing into registers or memory, so no result depends on it, and a line it brings may be
evicted before its reader comes. Chunks are spread over about one program an SM, 32 chunks a program (one a
thread): a single SM's copy engine issuing every request would take far longer than the window it fills.
The interpreter (TRITON_INTERPRET=1) runs no inline assembly: there `l2_prefetch` launches nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import compiled

CHUNKS_A_PROGRAM = 32          # one chunk a thread of a one-warp program
MIN_CHUNK = 4096               # bytes; the instruction takes any multiple of 16 from a 16-byte aligned address
MAX_CHUNK = 1 << 20
ALIGN = 16


def chunk_table(ranges: list[tuple[int, int]], programs: int, device: torch.device) -> torch.Tensor:
    """int64 [C, 2]: (address, bytes) of the chunks that cover `ranges` ((address, bytes) each; widened to 16-byte
    bounds, which stay inside the tensors' allocations, themselves 16-byte aligned in torch), sized so that
    the chunks fill about `programs` programs of CHUNKS_A_PROGRAM, within MIN_CHUNK..MAX_CHUNK bytes."""
    spans = []
    for addr, size in ranges:
        if size <= 0:
            continue
        start = addr - addr % ALIGN
        end = -(-(addr + size) // ALIGN) * ALIGN
        spans.append((start, end))
    total = sum(end - start for start, end in spans)
    chunk = -(-total // max(1, programs * CHUNKS_A_PROGRAM))
    chunk = min(MAX_CHUNK, max(MIN_CHUNK, -(-chunk // ALIGN) * ALIGN))
    rows = [(a, min(chunk, end - a)) for start, end in spans for a in range(start, end, chunk)]
    return torch.tensor(rows, dtype=torch.int64, device=device).view(-1, 2)


def tensor_rows(t: torch.Tensor, start: float, end: float) -> tuple[int, int]:
    """(address, bytes) of rows [start * R, end * R) of a row-major tensor's R rows (fractions in [0, 1])."""
    if not t.is_contiguous():
        raise ValueError("prefetch ranges are taken from contiguous tensors")
    rows = t.shape[0] if t.dim() else 1
    row_bytes = t.nbytes // max(1, rows)
    r0, r1 = round(start * rows), round(end * rows)
    return t.data_ptr() + r0 * row_bytes, (r1 - r0) * row_bytes


@triton.jit
def _prefetch_kernel(table_ptr, num_chunks, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < num_chunks
    addr = tl.load(table_ptr + 2 * idx, mask=mask, other=0)
    size = tl.load(table_ptr + 2 * idx + 1, mask=mask, other=0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


def supported(device: torch.device) -> bool:
    """Whether `device` runs the bulk prefetch (sm_90 and later, compiled kernels)."""
    return (device.type == "cuda" and compiled() and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


def l2_prefetch(table: torch.Tensor) -> None:
    """Launches the prefetch of every chunk of `table` (`chunk_table`) on the current stream; nothing where the
    device does not run it (`supported`)."""
    n = table.shape[0]
    if n == 0 or not supported(table.device):
        return
    _prefetch_kernel[(triton.cdiv(n, CHUNKS_A_PROGRAM),)](table, n, BLOCK=CHUNKS_A_PROGRAM, num_warps=1)
