"""Decode steps as CUDA graphs, one per batch-size bucket and set of LoRA groups (none for base steps).

A decode step's shapes depend only on its batch size, so the whole forward
(embedding -> layers with paged-attention decode and LoRA kernels -> logits)
is captured once per bucket against static buffers and then replayed: a step
costs one graph launch instead of ~10 kernel launches per layer. Every input
that changes between steps lives in a preallocated device tensor refilled with
`copy_` from pinned host memory before the replay: token ids, positions, KV
slots, block tables, context lengths, and the LoRA batch metadata (prepared by
the backend outside the graph). A batch is padded up to its bucket with rows
that attend one key in a scratch KV block no sequence owns and use no adapter,
so padding never touches real state. Nothing inside the step syncs with the host.

A LoRA graph holds the launches of the groups its step's adapters change (`LoraBackend.groups_of`): a
batch of adapters on q/k/v alone replays a graph with no LoRA launch on o, gate/up or down. The warm-up
captures every group and q/k/v alone (`WARM_GROUPS`); a step with another set replays the bucket's
every-group graph where there is one (its extra groups add zeros), so serving never stops to capture
one, and captures its own set only where the bucket has none (`graph_groups`).
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from compute_service.engine.attention import DecodeMetadata
from compute_service.engine.lora_backend import ALL_GROUPS, NO_ADAPTER, LoraBackend
from compute_service.engine.graph_capture import capture
from compute_service.engine.model import LlamaModel
from compute_service.engine.pending import PendingTokens, fill_pending
from compute_service.engine.prefill_graphs import PrefillGraphs


# LoRA group sets captured at start: adapters on every projection, and on the attention q/k/v alone.
WARM_GROUPS: tuple[frozenset[str], ...] = (ALL_GROUPS, frozenset({"qkv"}))
GraphKey = tuple[int, "frozenset[str] | None"]      # (bucket, LoRA groups; None for a base step)


def graph_groups(bucket: int, groups: frozenset[str], captured: "dict[GraphKey, object]") -> frozenset[str]:
    """The LoRA groups a step of `bucket` runs with: its own set when that graph exists or is one of
    `WARM_GROUPS`, else every group when that graph exists (a superset is correct: groups no adapter of
    the step has add zeros), else its own set, captured then."""
    if (bucket, groups) in captured or groups in WARM_GROUPS or (bucket, ALL_GROUPS) not in captured:
        return groups
    return ALL_GROUPS


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to (and including) `max_batch`."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """Captures decode graphs lazily (first use of a bucket) and replays them."""

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_batch: int, max_blocks_per_seq: int, scratch_block: int, prefill_tokens: int = 0) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.scratch_block = scratch_block
        dev, n, m = model.device, self.max_batch, max_blocks_per_seq
        self._allocate_inputs(dev, n, m)
        self._staged = torch.cuda.Event() if dev.type == "cuda" else None   # the staging's last copies queued
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._last_lora_key: dict[int, GraphKey] = {}      # bucket -> key of its last LoRA replay
        self._pool = torch.cuda.graph_pool_handle()
        # Prefill and mixed steps of up to `prefill_tokens` tokens: one graph per token-count bucket.
        self.prefill = PrefillGraphs(model, kv_caches, prefill_tokens, scratch_block * block_size, block_size,
                                     n, m)

    def _allocate_inputs(self, dev: torch.device, n: int, m: int) -> None:
        """Every per-step input in one byte layout, the same on the host (pinned) and on the device, so a
        step's inputs travel in one copy: ids, positions and KV slots (int64 [3, n]), context lengths (int32
        [n]), block tables (int32 [n, m]; a step copies only its bucket's rows of them)."""
        self._ctx_off, self._tables_off = 24 * n, 28 * n
        nbytes = self._tables_off + 4 * n * m
        self._host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        self._dev = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        views = [(b[: self._ctx_off].view(torch.int64).view(3, n), b[self._ctx_off: self._tables_off].view(torch.int32),
                  b[self._tables_off:].view(torch.int32).view(n, m)) for b in (self._dev, self._host)]
        (dev_i64, dev_ctx, dev_tables), (host_i64, host_ctx, host_tables) = views
        dev_ctx.fill_(1)
        host_ctx.fill_(1)
        self.input_ids, self.positions = dev_i64[0], dev_i64[1]
        self.meta = DecodeMetadata(dev_i64[2], dev_tables, dev_ctx)
        self._i64, self._ctx, self._tables = host_i64.numpy(), host_ctx.numpy(), host_tables.numpy()

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def run(self, input_ids: list[int], positions: list[int], tables: list[list[int]], token_slots: list[int],
            lora: LoraBackend | None, pending: PendingTokens | None = None) -> torch.Tensor:
        """Logits [B, V] float32 (a fresh tensor) of one decode token per sequence; `lora` None = base only;
        `pending`: rows whose token comes from the step in flight, on the device."""
        n = len(input_ids)
        bucket = self.bucket_for(n)
        if bucket is None:
            raise ValueError(f"decode batch {n} exceeds the largest graph bucket {self.max_batch}")
        self._fill(input_ids, positions, tables, bucket)
        if pending is not None:
            fill_pending(self.input_ids, pending)
        groups = None
        if lora is not None:
            groups = graph_groups(bucket, lora.groups_of(token_slots), self._graphs)
            lora.prepare(torch.tensor(token_slots + [NO_ADAPTER] * (bucket - n), dtype=torch.int32), groups)
        key: GraphKey = (bucket, groups)
        if groups is not None:
            self._last_lora_key[bucket] = key
        if key not in self._graphs:
            self._graphs[key] = self._capture(bucket, lora)
        graph, logits = self._graphs[key]
        graph.replay()
        # Graphs share one memory pool, so the next replay may reuse this output: hand out a copy.
        return logits[:n].clone()

    def capture_all(self, lora: LoraBackend | None) -> None:
        """Captures every bucket now (base, and with `lora` when given for each of `WARM_GROUPS`) on
        all-padding inputs, and the prefill graphs (`prefill_graphs.PrefillGraphs.capture_all`).

        For callers with other threads issuing CUDA work (the compute service's
        adapter uploads and packs): capturing before those threads start means
        no capture ever overlaps them. The LoRA graphs are captured with slot 0
        on every row so the eager warm-up compiles the kernels (an empty slot has
        rank 0 and adds nothing); a replay reads whatever `prepare` last wrote.
        """
        for bucket in self.buckets:
            for groups in (None, *WARM_GROUPS) if lora is not None else (None,):
                key: GraphKey = (bucket, groups)
                if key in self._graphs:
                    continue
                self._fill([], [], [], bucket)
                if lora is not None and groups is not None:
                    lora.prepare(torch.zeros(bucket, dtype=torch.int32), groups)
                self._graphs[key] = self._capture(bucket, lora if groups is not None else None)
        self.prefill.capture_all(lora)
        torch.cuda.synchronize(self.model.device)

    def _fill(self, input_ids: list[int], positions: list[int], tables: list[list[int]], bucket: int) -> None:
        """Writes the step's inputs (rows past the batch: padding) into the static device buffers."""
        if self._staged is not None:
            # The host staging is refilled only once the previous step's copies out of it ran: with
            # overlapped steps the host gets here while that step may still be queued behind another.
            self._staged.synchronize()
        n = len(input_ids)
        bs = self.block_size
        self._i64[0, :n] = input_ids
        self._i64[1, :n] = positions
        self._i64[0:2, n:bucket] = 0
        self._i64[2, n:bucket] = self.scratch_block * bs
        self._ctx[n:bucket] = 1
        self._tables[n:bucket, 0] = self.scratch_block
        if n:
            # A handful of numpy calls for the whole batch, none per sequence (at 128 sequences a write per
            # table row took ~0.2 ms of the engine thread's step, measured in the compute service).
            lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
            starts = np.zeros(n, dtype=np.int64)
            np.cumsum(lens[:-1], out=starts[1:])
            flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64,
                               count=int(starts[-1] + lens[-1]))
            pos = self._i64[1, :n]
            self._i64[2, :n] = flat[starts + pos // bs] * bs + pos % bs
            self._ctx[:n] = pos
            self._ctx[:n] += 1
            rows = np.repeat(np.arange(n), lens)
            self._tables[rows, np.arange(len(flat)) - starts[rows]] = flat
        end = self._tables_off + 4 * bucket * self._tables.shape[1]
        self._dev[:end].copy_(self._host[:end], non_blocking=True)
        if self._staged is not None:
            self._staged.record()

    def graph_for(self, batch: int, with_lora: bool) -> torch.cuda.CUDAGraph | None:
        """`batch`'s bucket graph (with LoRA: the graph of the bucket's last LoRA step), None if not
        captured yet (for benchmarks: replaying it repeats the last step's inputs)."""
        bucket = self.bucket_for(batch)
        key = self._last_lora_key.get(bucket) if with_lora else (bucket, None)
        entry = self._graphs.get(key) if bucket is not None and key is not None else None
        return None if entry is None else entry[0]

    def time_replay(self, batch: int, with_lora: bool, iters: int = 20) -> float | None:
        """Median GPU milliseconds of one replay of `graph_for(batch, with_lora)`, None if not captured yet.

        Replays the last step's inputs again (it rewrites the same K/V slots), so
        call it between steps; it measures the device time a step needs, without
        the host's share.
        """
        graph = self.graph_for(batch, with_lora)
        return None if graph is None else median_replay_ms(graph, iters)

    def _forward(self, bucket: int, lora: LoraBackend | None) -> torch.Tensor:
        meta = DecodeMetadata(self.meta.slot_mapping[:bucket], self.meta.block_tables[:bucket],
                              self.meta.context_lens[:bucket])
        hidden = self.model.forward(self.input_ids[:bucket], self.positions[:bucket], meta, self.kv_caches, lora)
        return self.model.compute_logits(hidden)

    def _capture(self, bucket: int, lora: LoraBackend | None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The warm run computes exactly what the replay will, so writing this step's K/V twice is harmless.
        return capture(lambda: self._forward(bucket, lora), self._pool)


def median_replay_ms(graph: torch.cuda.CUDAGraph, iters: int = 20) -> float:
    """Median GPU milliseconds of one replay of `graph` (one untimed replay first), CUDA events around each."""
    graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def host_tables_width(max_model_len: int, block_size: int) -> int:
    """Pages a sequence of `max_model_len` tokens can hold."""
    return -(-max_model_len // block_size)

