"""Prefill and mixed steps as one CUDA graph per token-count bucket, attention included.

A prefill or mixed step's attention depends on how its tokens split into
sequences; the paged prefill kernel (`kernels/paged_prefill.py`) reads that
split from two small device tables (query tiles and block tables), so the whole
forward can be captured once per bucket and replayed with new tables. Each
step's token count is padded up to a bucket (16, 32, 64, ... up to
`max_tokens`); the graph runs

    embed -> per layer: norm -> q/k/v (+LoRA) -> RoPE + K/V write -> paged attention
             -> o (+LoRA) -> norm -> gate/up (+LoRA) -> SwiGLU -> down (+LoRA) -> final norm

over static buffers (token ids, positions, KV slots, tiles, block tables, the
residual stream h, the normed x, q, the attention output, the final hidden
states). The attention kernel runs one program per possible tile of the bucket
(a step has at most as many tiles as tokens); tiles past the step's own are
all zero and do nothing. Padding rows use token 0, position 0, no adapter,
write their K/V into the scratch slot no sequence owns and get no attention
(their attention rows keep whatever was there, always finite); every other op
is row-wise, so padding never changes a real row.

Before the attention kernel existed this was L + 1 graph pieces with an eager
attention between two: the step was bound by the host (~17 ms for 34 tokens of
a 135M model on an H100 without adapters, ~60 ms with, for ~2 ms of GPU work,
when everything ran eagerly). Graphs are captured per (bucket, with LoRA) on
all-padding inputs, never during a real step (the forward updates h in place,
so an eager run followed by a capture would not be idempotent). Off under
tensor parallelism (the eager path is used there).
"""
from __future__ import annotations

import numpy as np
import torch

from compute_service.engine.attention import new_token_slots
from compute_service.engine.graph_capture import capture
from compute_service.engine.lora_backend import NO_ADAPTER, LoraBackend
from compute_service.engine.model import LlamaModel
from kernels.paged_prefill import paged_attention_prefill, prefill_tiles

MIN_BUCKET = 16
POW2_BUCKETS_UP_TO = 512   # buckets double up to here ...
LINEAR_BUCKET_STEP = 256   # ... and grow by this much above it, so a large step pads by less than 256 tokens


def prefill_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, ... 512 (powers of two), then 768, 1024, ... (steps of 256) below `max_tokens`, then
    `max_tokens` itself; [] if it is 0. Above 512 a power-of-two bucket would pad a step of 513 tokens to
    1,024; steps of 256 keep the padding under a third of a step there (under an eighth at 2,048)."""
    if max_tokens <= 0:
        return []
    sizes, b = [], MIN_BUCKET
    while b < max_tokens:
        sizes.append(b)
        b = b * 2 if b < POW2_BUCKETS_UP_TO else b + LINEAR_BUCKET_STEP
    return sizes + [max_tokens]


class PrefillGraphs:
    """Captures a bucket's whole forward once, replays it with the step's tokens, tiles and block tables."""

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_tokens: int,
                 scratch_slot: int, block_size: int, max_seqs: int, max_blocks_per_seq: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = prefill_buckets(max_tokens)
        self.max_tokens = self.buckets[-1] if self.buckets else 0
        self.scratch_slot = scratch_slot
        self.block_size = block_size
        spec, dev, dtype, n = model.spec, model.device, model.dtype, self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), scratch_slot, dtype=torch.int64, device=dev)
        self.h = torch.zeros(n, spec.hidden_size, dtype=dtype, device=dev)
        self.x = torch.zeros(n, spec.hidden_size, dtype=dtype, device=dev)
        self.q = torch.zeros(n, spec.num_heads, spec.head_dim, dtype=dtype, device=dev)
        self.attn = torch.zeros(n, spec.q_size, dtype=dtype, device=dev)
        self.out = torch.zeros(n, spec.hidden_size, dtype=dtype, device=dev)
        self.tiles = torch.zeros(n, 4, dtype=torch.int32, device=dev)            # all zero: no tile
        self.tables = torch.zeros(max_seqs if n else 0, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._host = torch.zeros(3, n, dtype=torch.int64, pin_memory=True)       # ids, positions, slots
        self._host_np = self._host.numpy()
        self._host_tiles = torch.zeros(n, 4, dtype=torch.int32, pin_memory=True)
        self._host_tiles_np = self._host_tiles.numpy()
        self._host_tables = torch.zeros(self.tables.shape, dtype=torch.int32, pin_memory=True)
        self._host_tables_np = self._host_tables.numpy()
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if n else None

    @property
    def enabled(self) -> bool:
        return bool(self.buckets) and self.model.all_reduce is None

    @property
    def num_captured(self) -> int:
        """Graphs captured so far (every bucket, base and LoRA)."""
        return len(self._graphs)

    def bucket_for(self, num_tokens: int) -> int | None:
        if not self.enabled:
            return None
        for b in self.buckets:
            if b >= num_tokens:
                return b
        return None

    def fits(self, num_tokens: int, num_seqs: int, widest_table: int) -> bool:
        """Whether a step of this many tokens and sequences, with this many pages in its longest block table,
        can replay a graph."""
        return self.bucket_for(num_tokens) is not None and num_seqs <= self.tables.shape[0] \
            and widest_table <= self.tables.shape[1]

    def run(self, input_ids: list[int], positions: list[int], query_lens: list[int], context_lens: list[int],
            tables: list[list[int]], token_slots: list[int], lora: LoraBackend | None) -> torch.Tensor:
        """Final hidden states [T, H] of the step (a view of a static buffer: read it before the next run)."""
        n = len(input_ids)
        bucket = self.bucket_for(n)
        if bucket is None:
            raise ValueError(f"a step of {n} tokens has no prefill graph bucket (largest {self.max_tokens})")
        key = (bucket, lora is not None)
        if key not in self._graphs:
            self._graphs[key] = self._capture(bucket, lora)
        self._fill(input_ids, positions, new_token_slots(query_lens, context_lens, tables, self.block_size), bucket)
        self._fill_attention(query_lens, context_lens, tables, bucket)
        if lora is not None:
            lora.prepare(torch.tensor(token_slots + [NO_ADAPTER] * (bucket - n), dtype=torch.int32))
        self._graphs[key].replay()
        return self.out[:n]

    def capture_all(self, lora: LoraBackend | None) -> None:
        """Captures every bucket now (base, and with `lora` when given) on all-padding inputs."""
        if not self.enabled:
            return
        for bucket in self.buckets:
            for backend in (None, lora) if lora is not None else (None,):
                key = (bucket, backend is not None)
                if key not in self._graphs:
                    self._graphs[key] = self._capture(bucket, backend)
        torch.cuda.synchronize(self.model.device)

    def _fill(self, input_ids: list[int], positions: list[int], slots: list[int], bucket: int) -> None:
        """The step's ids, positions and KV slots; padding: token 0, position 0, the scratch slot."""
        n = len(input_ids)
        self._host_np[0, :n] = input_ids
        self._host_np[1, :n] = positions
        self._host_np[2, :n] = slots
        self._host_np[0:2, n:bucket] = 0
        self._host_np[2, n:bucket] = self.scratch_slot
        self.input_ids[:bucket].copy_(self._host[0, :bucket], non_blocking=True)
        self.positions[:bucket].copy_(self._host[1, :bucket], non_blocking=True)
        self.slot_mapping[:bucket].copy_(self._host[2, :bucket], non_blocking=True)

    def _fill_attention(self, query_lens: list[int], context_lens: list[int], tables: list[list[int]],
                        bucket: int) -> None:
        """The step's query tiles (the rest of the bucket's: zero, no work) and its sequences' block tables."""
        tiles = np.asarray(prefill_tiles(query_lens, context_lens), dtype=np.int32).reshape(-1, 4)
        k = len(tiles)
        self._host_tiles_np[:k] = tiles
        self._host_tiles_np[k:bucket] = 0
        self.tiles[:bucket].copy_(self._host_tiles[:bucket], non_blocking=True)
        for b, t in enumerate(tables):
            self._host_tables_np[b, :len(t)] = t
        self.tables[:len(tables)].copy_(self._host_tables[:len(tables)], non_blocking=True)

    def _forward(self, bucket: int, lora: LoraBackend | None):
        """The bucket's whole forward as a closure over the static buffers."""
        model, kv, b = self.model, self.kv_caches, bucket
        spec = model.spec
        ids, pos, slots = self.input_ids[:b], self.positions[:b], self.slot_mapping[:b]
        h, x, q, attn, out = self.h[:b], self.x[:b], self.q[:b], self.attn[:b], self.out[:b]
        attn_heads = attn.view(b, spec.num_heads, spec.head_dim)
        tiles, tables = self.tiles[:b], self.tables
        num_layers = len(model.weights.layers)

        def forward() -> None:
            torch.index_select(model.weights.embed, 0, ids, out=h)
            pending = None
            for i in range(num_layers):
                model.attention_in(i, pending, h, x, pos, slots, kv, q, lora)
                paged_attention_prefill(q, *kv[i], tables, tiles, attn_heads, model.scale)
                pending = model.attention_out_mlp(i, attn, h, x, lora)
            model.final_norm(pending, h, out)
        return forward

    def _capture(self, bucket: int, lora: LoraBackend | None) -> torch.cuda.CUDAGraph:
        """The bucket's graph, captured on all-padding inputs after one eager run (which compiles the Triton
        kernels and settles lazy allocations outside the capture)."""
        self._fill([], [], [], bucket)
        self.tiles[:bucket].zero_()
        if lora is not None:
            lora.prepare(torch.zeros(bucket, dtype=torch.int32))      # slot 0: the kernels' real code paths
        return capture(self._forward(bucket, lora), self._pool)[0]
