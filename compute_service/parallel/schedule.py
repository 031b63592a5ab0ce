"""Rank 0 drives, the other ranks follow: each step's inputs sent to every rank, the same forward.

Rank 0 owns the scheduler, the sampler and the service; before each forward it sends the step's
`StepInputs` (token ids, positions, block tables, adapter keys) through the step channel, with the
adapters first used in it and the keys rank 0 evicted since. Every rank then runs the same
forward over its shard; the all-reduces inside it keep the ranks in lock step, and only rank 0
reads the logits. A follower's KV pages and adapter pool mirror rank 0's (same sizes, same block
tables; adapters loaded and evicted on rank 0's word), so keys resolve to slots on every rank.

CUDA graphs hold the all-reduces, so every rank captures the same graphs in the same order: rank 0
broadcasts a "capture" command (`DriverRunner.capture_graphs`) and captures while the followers do.

Adapters are announced when rank 0 stages them (`adapter_ship.py`): followers stage their share on
a prefetch thread, and the first step using one only names it.
"""
from __future__ import annotations

import gc
import logging
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from compute_service.engine.model_runner import ModelRunner, StepInputs
from compute_service.engine.scheduler import SchedulerOutput
from compute_service.engine.spec import ModelSpec
from compute_service.parallel.adapter_ship import AdapterMailer, Prefetcher
from compute_service.parallel.group import ParallelGroupError, TensorParallelGroup
from compute_service.parallel.lora_split import split_adapter
from compute_service.parallel.shard import Shard
from loraplex.formats.adapter import Adapter

log = logging.getLogger(__name__)
CAPTURE = "capture"
PREFETCH = "prefetch"


@dataclass
class StepMessage:
    """What rank 0 broadcasts per step; `step` None = stop (or a `command`)."""

    step: StepInputs | None
    # first use of each adapter: the whole adapter, or None when it was announced (staged already)
    ship: list[tuple[str, Adapter | None]] = field(default_factory=list)
    evict: list[str] = field(default_factory=list)
    command: str = ""            # "capture": every decode graph now, in lock step; "prefetch": `files`
    files: list[tuple[str, str]] = field(default_factory=list)       # prefetch: (key, base path)


class ShardedSlots:
    """An adapter pool that keeps only this rank's share of every adapter it is given.

    Wraps the pool (`PagedAdapterSlots`) over the rank's local spec; `spec` is the whole model's (what
    adapters are built for). On rank 0 `announce` (the driver's) sends each adapter it stages to the
    followers at once; `unshipped` holds what the next step using a key must still tell them: the whole
    adapter, or None when it was announced.
    """

    def __init__(self, inner: Any, whole_spec: ModelSpec, shard: Shard,
                 mlp_orders: list[torch.Tensor | None] | None = None) -> None:
        self._inner = inner
        self.spec = self._whole_spec = whole_spec
        self._shard = shard
        self._mlp_orders = mlp_orders       # the MLP shards' act-order down orders (`sharded_source`)
        self.unshipped: dict[str, Adapter | None] = {}
        self.announce: Callable[[str, Adapter], bool] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def fingerprint(self) -> str | None:
        return self._inner.fingerprint  # type: ignore[no-any-return]

    @fingerprint.setter
    def fingerprint(self, value: str | None) -> None:
        self._inner.fingerprint = value

    def share(self, adapter: Adapter) -> Adapter:
        return split_adapter(adapter, self._whole_spec, self._shard, self._mlp_orders)

    def load(self, key: str, adapter: Adapter) -> int:
        slot = self._inner.load(key, self.share(adapter))
        self._remember(key, adapter)
        return int(slot)

    def stage_adapter(self, key: str, adapter: Adapter) -> Any:
        staged = self._inner.stage_adapter(key, self.share(adapter))
        self._remember(key, adapter)
        return staged

    def load_staged(self, key: str, staged: Any) -> int:
        """Installs this rank's share staged earlier (`stage_adapter`, on a prefetch thread)."""
        return int(self._inner.load_staged(key, staged))

    def _remember(self, key: str, adapter: Adapter) -> None:
        announced = self.announce is not None and self.announce(key, adapter)
        self.unshipped[key] = None if announced else adapter


class DriverRunner:
    """Rank 0's model runner: broadcasts each step, then runs it like any rank."""

    def __init__(self, runner: ModelRunner, slots: ShardedSlots, group: TensorParallelGroup) -> None:
        self._runner = runner
        self._slots = slots
        self._group = group
        self._shipped: set[str] = set()
        self._send_lock = threading.Lock()    # steps (engine thread) and announcements (loader threads)
        self._mailer = AdapterMailer(group.world_size)
        slots.announce = self._announce

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def run(self, out: SchedulerOutput, in_flight: Any = None) -> torch.Tensor:
        if in_flight is not None:       # followers read each step's tokens from rank 0's message
            raise ValueError("overlapped steps (async scheduling) are not supported with tensor parallelism")
        step = self._runner.inputs(out)
        evict = sorted(k for k in self._shipped if not self._slots.resident(k))
        self._shipped.difference_update(evict)
        ship = []
        for key in dict.fromkeys(k for k in step.adapter_keys if k is not None):
            if key in self._slots.unshipped:       # new, or replaced since it was shipped
                ship.append((key, self._slots.unshipped.pop(key)))
                self._shipped.add(key)
        try:
            self._send(StepMessage(step, ship, evict))
            return self._runner.run_inputs(step)
        except RuntimeError as e:      # a collective failed or timed out: a rank is gone
            log.error("tensor parallel group down: a rank failed or timed out (%s); this service stops", e)
            raise ParallelGroupError(f"tensor parallel group down: {e}") from e

    def capture_graphs(self) -> int:
        """Captures every decode graph on all ranks at once (their all-reduces pair up); returns how many
        this rank holds (0 without graphs: CPU, or graphs off)."""
        self._send(StepMessage(None, command=CAPTURE))
        return _capture(self._runner)

    @property
    def inner(self) -> ModelRunner:
        return self._runner

    def stop(self) -> None:
        """Releases the followers (they return from `follow`; they can be driven again after)."""
        self._send(StepMessage(None))

    def close(self) -> None:
        """Removes announced adapter files no follower read (the group is ending)."""
        self._mailer.close()

    def _send(self, msg: StepMessage) -> None:
        with self._send_lock:
            self._group.send_step(msg)

    def _announce(self, key: str, adapter: Adapter) -> bool:
        """Rank 0's loader thread: the whole adapter to every follower now, to stage while steps run.
        False (the first step using it ships it instead) when it cannot be written."""
        try:
            base = self._mailer.write(adapter)
        except (OSError, pickle.PicklingError) as e:
            log.warning("tensor parallel: adapter %s not announced (%s); it travels with its first step", key, e)
            return False
        self._send(StepMessage(None, command=PREFETCH, files=[(key, base)]))
        return True


def follow(runner: ModelRunner, slots: ShardedSlots, group: TensorParallelGroup) -> int:
    """A follower's loop: runs rank 0's steps until told to stop; returns the number of steps run."""
    num_steps = ahead = whole = 0
    prefetcher = Prefetcher(slots, group.rank)
    try:
        while True:
            msg: StepMessage = group.receive_step()
            if msg.command == CAPTURE:
                log.info("tensor parallel rank %d: captured %d decode graphs", group.rank, _capture(runner))
                continue
            if msg.command == PREFETCH:
                for key, base in msg.files:
                    prefetcher.announce(key, base)
                continue
            if msg.step is None:
                log.info("tensor parallel rank %d: stop after %d steps (adapters: %d staged ahead, %d sent whole "
                         "with their first step)", group.rank, num_steps, ahead, whole)
                return num_steps
            for key in msg.evict:
                slots.evict(key)
            for key, adapter in msg.ship:
                if adapter is None:                      # announced earlier: staged on the prefetch thread
                    slots.load_staged(key, prefetcher.take(key))
                    ahead += 1
                else:
                    slots.load(key, adapter)
                    whole += 1
                slots.unshipped.pop(key, None)
            runner.run_inputs(msg.step)
            num_steps += 1
    finally:
        prefetcher.close()


def _capture(runner: ModelRunner) -> int:
    """Every decode graph of the runner, base and with its LoRA backend (the same on every rank)."""
    graphs = runner.graphs
    if graphs is None:
        return 0
    graphs.capture_all(runner.lora)
    return 2 * len(graphs.buckets) if runner.lora is not None else len(graphs.buckets)


def release_graphs(runner: ModelRunner) -> None:
    """Frees the decode graphs before a rank leaves the group: captured NCCL work keeps the
    communicator busy, and `TensorParallelGroup.close` with graphs alive hangs on GPUs."""
    if runner.graphs is None:
        return
    runner.graphs = None
    gc.collect()
    torch.cuda.synchronize()
