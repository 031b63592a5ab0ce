"""Rank 0's model run alone, without its peers: for the warm-up's compile pass under tensor parallelism.

A forward of the sharded model all-reduces o's and down's partial outputs, which pairs it with the same
forward on every other rank. The compile pass only needs rank 0's launches (each rank's shard has the same
shapes, so the programs compiled there are every rank's; the followers read them from the kernel cache on
disk when they capture their graphs and run the warm-up's requests). Inside `peers_skipped` the model's
row-parallel sums are this rank's alone: the all-reduce does nothing and the add + norm after it runs on
the local partial sum. The numbers are wrong for the whole model and must not be kept: the compile pass
throws its outputs away and zeroes the KV cache after it.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _no_all_reduce(t: torch.Tensor) -> None:
    """The all-reduce over one rank: `t` is its own sum."""


def _local_add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                        slot: int) -> None:
    """`TensorParallelGroup.reduce_add_rms_norm` over one rank: h += x; out = RMSNorm(h) * weight."""
    from kernels.rms_norm import add_rms_norm      # Triton: imported on first use

    add_rms_norm(x, h, weight, eps, out, h)


@contextmanager
def peers_skipped(model: Any) -> Iterator[None]:
    """`model` (a `LlamaModel` sharded over a group, `shard_over`) runs its forwards on this rank alone until
    the block ends; the group's collectives are its own again after it, also on an error."""
    if model.all_reduce is None:
        raise ValueError("the model is not sharded over a tensor parallel group")
    saved = model.all_reduce, model.reduce_add_norm
    model.all_reduce, model.reduce_add_norm = _no_all_reduce, _local_add_rms_norm
    try:
        yield
    finally:
        model.all_reduce, model.reduce_add_norm = saved
