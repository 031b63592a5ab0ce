"""A one-shot all-reduce over GPU peer memory for the small rows of decode steps.

NCCL took about 22 us per all-reduce of a [1, 4096] bf16 row on 2 H200s inside a CUDA graph, 64 per
8B decode step (1.2-1.4 ms of a 3.7 ms step at TP=2). Here each rank copies its partial sums into a
buffer every rank has mapped (symmetric memory, over NVLink / PCIe peer access, no multicast) and
one kernel per rank reads all the ranks' copies and writes the sum: one launch, no protocol.
Where the sum feeds the residual add and the next RMSNorm (every decode all-reduce), one kernel of
ours does all three (`kernels/all_reduce_norm.py`): one launch per layer boundary instead of three.
Larger tensors (prefill) keep NCCL. `LORAPLEX_TP_ALL_REDUCE`: `auto` (default: fused where it fits),
`oneshot` (the library's one-shot all-reduce, then the add + norm), `nccl` (NCCL only). If the set-up
fails (no peer access, an older PyTorch), the group logs why and stays on NCCL.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)
MAX_BYTES = 1 << 20                  # per call; a [64, 8192] bf16 decode row block is exactly this
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ENV = "LORAPLEX_TP_ALL_REDUCE"       # auto (default), oneshot or nccl
MODES = ("auto", "oneshot", "nccl")
DEFAULT_SIGNAL_PAD_BYTES = 2048      # the library's default, where it cannot say
# Rows the fused kernel takes at most: its programs wait for their peers' programs, so every program of
# a launch must be resident at once on every rank (256 programs of 8 warps: 2 per SM on a 132-SM GPU).
MAX_FUSED_ROWS = 256


class PeerAllReduce:
    """Symmetric buffers (one per dtype) rendezvoused on `group_name`; `__call__` sums in place."""

    def __init__(self, group_name: str, device: torch.device, fuse: bool = True, timeout_s: float = 120.0) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")   # one-shot reads peers, no multicast
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            enable(group_name)
        self.group_name = group_name
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        for dtype in DTYPES:
            numel = MAX_BYTES // torch.empty((), dtype=dtype).element_size()
            buf = symm_mem.empty(numel, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, group_name)
            self._buffers[dtype] = buf
        # The library's one-shot copies the input into the peer buffer itself where it can (one launch).
        self._copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)
        self._norm: _FusedNorm | None = _FusedNorm(group_name, device, symm_mem, timeout_s) if fuse else None

    def takes(self, t: torch.Tensor) -> bool:
        """Small, contiguous, a whole number of 16-byte words (the kernel's vector width)."""
        nbytes = t.numel() * t.element_size()
        return t.dtype in self._buffers and t.is_contiguous() and nbytes <= MAX_BYTES and nbytes % 16 == 0

    def __call__(self, t: torch.Tensor) -> None:
        flat = t.view(-1)
        buf = self._buffers[t.dtype][: flat.numel()]
        if self._copy_out is not None:
            self._copy_out(buf, flat, "sum", self.group_name, flat)
        else:
            buf.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", self.group_name, flat)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether `reduce_add_rms_norm` takes x: fusion on, within the one-shot's bounds and the fused
        kernel's (elsewhere the caller all-reduces, then adds and normalises)."""
        return self._norm is not None and self.takes(x) and self._norm.takes(x)

    def reduce_add_rms_norm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                            out: torch.Tensor, slot: int) -> None:
        """h += sum over ranks of x; out = RMSNorm(h) * weight, in one launch (only where `fuses(x)`).
        Consecutive calls must alternate `slot` (0, 1)."""
        self._norm(x, h, weight, eps, out, slot)


class _FusedNorm:
    """The fused all-reduce + add + RMSNorm's peer-mapped buffer (two halves) and signal pads."""

    def __init__(self, group_name: str, device: torch.device, symm_mem: Any, timeout_s: float) -> None:
        self.timeout_s = timeout_s          # a peer this late traps the kernel: the group goes down, no hang
        self.status = torch.zeros(1, dtype=torch.int32, device=device)
        self._buf = symm_mem.empty(2 * MAX_BYTES, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self._buf, group_name)
        self.rank, self.world = handle.rank, handle.world_size
        self.buffer_ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.pad_ptrs = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)
        pad_bytes = getattr(symm_mem, "get_signal_pad_size", lambda: DEFAULT_SIGNAL_PAD_BYTES)()
        self.max_rows = min(MAX_FUSED_ROWS, pad_bytes // 4 // self.world)   # one int32 flag per (row, rank)

    def takes(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype in DTYPES and x.is_contiguous() and x.shape[0] <= self.max_rows \
            and x.numel() * x.element_size() <= MAX_BYTES

    def __call__(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                 slot: int) -> None:
        from kernels.all_reduce_norm import reduce_add_rms_norm

        reduce_add_rms_norm(x, h, weight, eps, out, self.buffer_ptrs, self.pad_ptrs,
                            slot * (MAX_BYTES // x.element_size()), self.rank, self.status, self.timeout_s)


def try_peer_all_reduce(device_group: Any, device: torch.device, world: int,
                        agree: Callable[[int], int], timeout_s: float = 120.0) -> PeerAllReduce | None:
    """The fast path for this group, or None (CPU, one rank, turned off, or not available here).
    Collective: every rank calls it at the same point; `agree` (the minimum over the ranks) makes
    the ranks take the same path, or one would wait in NCCL for peers that reduce elsewhere."""
    mode = os.environ.get(ENV, "auto")
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: use one of {', '.join(MODES)}")
    if device.type != "cuda" or world < 2:
        return None
    if mode == "nccl":
        log.info("tensor parallel: all-reduce on NCCL only (%s=nccl)", ENV)
        return None
    try:
        fast = PeerAllReduce(device_group.group_name, device, fuse=mode == "auto", timeout_s=timeout_s)
        probe = torch.ones(8, dtype=torch.float32, device=device)
        fast(probe)
        torch.cuda.synchronize(device)
        if not bool((probe == world).all()):
            raise RuntimeError(f"the probe summed to {probe.tolist()}, not {world}")
        _probe_fused(fast, device, world)
    except Exception as e:   # an older PyTorch, no peer access, no symmetric memory backend: NCCL does it all
        log.warning("tensor parallel: one-shot peer all-reduce unavailable (%s: %s); all-reduces on NCCL",
                    type(e).__name__, e)
        agree(0)
        return None
    if not agree(1):
        log.warning("tensor parallel: another rank cannot use the one-shot peer all-reduce; all-reduces on NCCL")
        return None
    log.info("tensor parallel: all-reduces up to %d KiB one-shot over peer memory%s, larger ones on NCCL",
             MAX_BYTES >> 10, " (fused with the residual add and RMSNorm)" if mode == "auto" else "")
    return fast


def _probe_fused(fast: PeerAllReduce, device: torch.device, world: int) -> None:
    """Both halves of the fused kernel once, on rows of ones: h must come back as world + 1."""
    x = torch.ones(2, 64, dtype=torch.float32, device=device)
    if not fast.fuses(x):
        return
    for slot in (0, 1):
        h = torch.ones_like(x)
        fast.reduce_add_rms_norm(x, h, torch.ones(64, device=device), 1e-6, torch.empty_like(x), slot)
        torch.cuda.synchronize(device)
        if not bool((h == world + 1).all()):
            raise RuntimeError(f"the fused probe's residual came back as {h.unique().tolist()}, not {world + 1}")
