"""Device-side mapping from a program id to (segment, token tile), shared by shrink and expand.

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
