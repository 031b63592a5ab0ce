"""The tensor-parallel process group: one process per rank, started by a launcher that sets
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun, or `loraplex compute --tensor-parallel-size`).

Every collective has a timeout, so a rank that dies brings the others down with an error instead of a
hang: activations are all-reduced on the device group (NCCL on CUDA, whose watchdog aborts a stuck
collective; gloo on CPU); each step's inputs travel through a shared-memory `StepChannel` (the ranks
share one host), other objects and oversized steps on a gloo control group.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from compute_service.parallel.fast_all_reduce import PeerAllReduce, try_peer_all_reduce
from compute_service.parallel.step_channel import StepChannel

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 120.0
STEP_CHANNEL_BYTES = 8 << 20       # a step's inputs; larger messages (adapters shipped) use the control group


class ParallelGroupError(RuntimeError):
    """The group could not start, or a rank failed: the whole group must go down."""


@dataclass
class TensorParallelGroup:
    """This process's place in the group and the two process groups it talks on."""

    rank: int
    world_size: int
    device: torch.device
    device_group: Any          # all-reduce of activations (NCCL or gloo)
    control_group: Any         # host objects (gloo)
    timeout_s: float = DEFAULT_TIMEOUT_S
    control_timeout_s: float = DEFAULT_TIMEOUT_S     # a follower's wait for the next step
    channel: StepChannel | None = None               # step inputs, rank 0 -> followers
    peer_all_reduce: PeerAllReduce | None = None     # small all-reduces over GPU peer memory

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sums `t` in place over the ranks (a row-parallel layer's partial outputs): one-shot over peer
        memory when small (decode rows), NCCL or gloo otherwise."""
        fast = self.peer_all_reduce
        if fast is not None and fast.takes(t):
            fast(t)
        else:
            dist.all_reduce(t, group=self.device_group)

    def reduce_add_rms_norm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                            out: torch.Tensor, slot: int) -> None:
        """h += sum over ranks of x (a row-parallel layer's partial output); out = RMSNorm(h) * weight.
        Decode rows: one fused launch over peer memory; otherwise the all-reduce (one-shot or NCCL, as
        `all_reduce` picks), then the add + norm. Consecutive calls alternate `slot` (0, 1): the fused
        kernel's buffer halves."""
        fast = self.peer_all_reduce
        if fast is not None and fast.fuses(x):
            fast.reduce_add_rms_norm(x, h, weight, eps, out, slot)
            return
        from kernels.rms_norm import add_rms_norm      # Triton: imported on first use

        self.all_reduce(x)
        add_rms_norm(x, h, weight, eps, out, h)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled over the control group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def send_step(self, obj: Any) -> None:
        """Rank 0: the next step message to every follower (`receive_step` there)."""
        if self.channel is None:
            self.broadcast_object(obj)
        else:
            self.channel.send(obj, self.timeout_s)

    def receive_step(self) -> Any:
        """A follower: rank 0's next `send_step` message."""
        if self.channel is None:
            return self.broadcast_object()
        return self.channel.receive(self.control_timeout_s)

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (KV blocks must agree: rank 0's block tables index all)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def close(self) -> None:
        """Leaves the group once every rank is done (a barrier first, so no rank tears down early)."""
        if dist.is_initialized():
            dist.barrier(group=self.control_group)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dist.destroy_process_group()
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def init_group(device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S,
               control_timeout_s: float | None = None) -> TensorParallelGroup:
    """Joins the group described by the launcher's environment; CUDA ranks take GPU `LOCAL_RANK`.

    `control_timeout_s` bounds a follower's wait for rank 0's next step (a served group idles between
    requests: give it a long one; a dead rank 0 still fails the wait at once, its connection closes).
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ParallelGroupError(f"tensor parallelism needs a launcher: {', '.join(missing)} not set "
                                 "(start with `loraplex compute --tensor-parallel-size N` or torchrun)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        if local >= torch.cuda.device_count():
            raise ParallelGroupError(f"rank {rank} wants GPU {local} but this host has {torch.cuda.device_count()}")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
        device_group = dist.group.WORLD
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        device_group = dist.group.WORLD
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=control_timeout_s or timeout_s))
    group = TensorParallelGroup(rank, world, device, device_group, control, timeout_s,
                                control_timeout_s or timeout_s)
    if world > 1:
        group.channel = _open_channel(group)
        group.peer_all_reduce = try_peer_all_reduce(device_group, device, world, group.min_int, timeout_s)
    log.info("tensor parallel rank %d/%d on %s joined the group", rank, world, device)
    return group


def _open_channel(group: TensorParallelGroup) -> StepChannel:
    """Rank 0 makes the shared file, every rank maps it, then rank 0 unlinks it (the mappings stay)."""
    path = group.broadcast_object(StepChannel.create(STEP_CHANNEL_BYTES) if group.is_driver else None)
    try:
        channel = StepChannel(path, group.rank, group.world_size, STEP_CHANNEL_BYTES,
                              spin=group.device.type == "cuda", fallback_send=group.broadcast_object,
                              fallback_receive=group.broadcast_object)
    except OSError as e:
        raise ParallelGroupError(f"rank {group.rank} cannot map rank 0's step channel {path} "
                                 f"(every rank must run on one host): {e}") from None
    finally:
        dist.barrier(group=group.control_group)
        if group.is_driver:
            os.unlink(path)
    return channel
