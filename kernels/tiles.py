"""Device-side helpers shared by the LoRA kernels: program id -> (segment, token tile), and the shrink loop.

Segments (tokens of one adapter) are cut into tiles of BLOCK_M tokens. The
launch grid has an upper bound of tiles known on the host (cdiv(T, BLOCK_M) plus
one per possible segment); each program finds its tile from the segment
starts with one vector scan, so no host sync or per-step tile table is needed
and programs past the last tile exit at once. Entries of `seg_starts` past the
active segments repeat the end, so they count zero tiles and the scan needs no
segment count (one dependent memory round trip fewer).
"""
import triton
import triton.language as tl

from kernels.dots import dot


@triton.jit
def segment_tile(pid, seg_starts_ptr, max_slots, BLOCK_M: tl.constexpr, MAX_SEGS: tl.constexpr):
    """Returns (number of tiles, segment, first sorted position of the tile, end of the segment).

    The program has no work when pid >= number of tiles.
    """
    idx = tl.arange(0, MAX_SEGS)
    live = idx < max_slots
    starts = tl.load(seg_starts_ptr + idx, mask=live, other=0)
    ends = tl.load(seg_starts_ptr + idx + 1, mask=live, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M                 # tiles per segment
    cum = tl.cumsum(tiles, 0)                                         # inclusive
    total = tl.sum(tiles, 0)
    seg = tl.sum((cum <= pid).to(tl.int32), 0)                        # first segment whose cum exceeds pid
    here = idx == seg
    first_tile = tl.sum(tl.where(here, cum - tiles, 0), 0)
    seg_start = tl.sum(tl.where(here, starts, 0), 0)
    seg_end = tl.sum(tl.where(here, ends, 0), 0)
    m_start = seg_start + (pid - first_tile) * BLOCK_M
    return total, seg, m_start, seg_end


@triton.jit
def shrink_tile(x_ptr, x_stride, toks, m_mask, pool_ptr, rows, r_mask, k_lo, k_hi, K,
                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                IEEE: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_R]: x[toks, k_lo:k_hi] @ A[rows, k_lo:k_hi].T, A's rows read in place from the pool."""
    offs_kb = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = tl.max_contiguous(tl.multiple_of(k + offs_kb, BLOCK_K), BLOCK_K)
        if EVEN_K:
            xt = tl.load(x_ptr + toks[:, None] * x_stride + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            at = tl.load(pool_ptr + rows[:, None] + offs_k[None, :], mask=r_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < K
            xt = tl.load(x_ptr + toks[:, None] * x_stride + offs_k[None, :],
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(pool_ptr + rows[:, None] + offs_k[None, :],
                         mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += dot(xt, tl.trans(at), IEEE)
    return acc


@triton.jit
def pick4(i, v0, v1, v2, v3):
    """v_i for i in 0..3 (per-slice launch arguments)."""
    return tl.where(i == 0, v0, tl.where(i == 1, v1, tl.where(i == 2, v2, v3)))


@triton.jit
def table_entry(seg_slots_ptr, seg, module, layer, num_layers, num_modules):
    """Flat index into the row tables of (slot of segment `seg`, layer, module)."""
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    return (slot * num_layers + layer) * num_modules + module
