"""Prefill and mixed steps as CUDA graphs in pieces: everything between two attentions is replayed.

A prefill or mixed step's attention depends on how its tokens split into
sequences (padded tiles, masks), so it stays eager; everything else in a layer
(norms, q/k/v, o, gate/up, down, their LoRA, RoPE and the K/V cache write)
depends only on the token count. Each step's token count is padded up to a
bucket (16, 32, 64, ... up to `max_tokens`) and the forward runs as L + 1
captured pieces with an eager attention between two pieces:

    piece 0:  embed -> norm -> q/k/v (+LoRA) -> RoPE + K/V write         (layer 0)
    piece i:  o (+LoRA) -> norm -> gate/up (+LoRA) -> SwiGLU -> down (+LoRA)   (layer i-1)
              -> norm -> q/k/v (+LoRA) -> RoPE + K/V write              (layer i)
    piece L:  o ... down of the last layer -> final norm

For a short prompt that is L + 1 graph launches and L attentions instead of
~10 launches per layer, each with its own host overhead (the step was bound by
the host: ~17 ms for 34 tokens of a 135M model on an H100 without adapters,
~60 ms with, for ~2 ms of GPU work). Pieces read and write static buffers
(token ids, positions, KV slots, the residual stream h, the normed x, q, the
attention output, the final hidden states); their intermediates live in one
graph pool that the pieces share, which is safe because pieces are replayed
one after another on one stream. Padding rows use token 0, position 0, no
adapter, and write their K/V into the scratch slot no sequence owns; every op
in a piece is row-wise, so padding never changes a real row.

Graphs are captured per (bucket, with LoRA) on all-padding inputs, never
during a real step (a piece updates h in place, so an eager run followed by a
capture would not be idempotent). Off under tensor parallelism (the eager path
is used there).
"""
from __future__ import annotations

import torch

from compute_service.engine.attention import AttentionMetadata, PrefillMetadata, paged_attention
from compute_service.engine.graph_capture import capture
from compute_service.engine.lora_backend import NO_ADAPTER, LoraBackend
from compute_service.engine.model import LlamaModel

MIN_BUCKET = 16


def prefill_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, ... (powers of two) below `max_tokens`, then `max_tokens` itself; [] if it is 0."""
    if max_tokens <= 0:
        return []
    sizes, b = [], MIN_BUCKET
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    return sizes + [max_tokens]


class PrefillGraphs:
    """Captures the pieces of a bucket's forward once, replays them with eager attention in between."""

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_tokens: int,
                 scratch_slot: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = prefill_buckets(max_tokens)
        self.max_tokens = self.buckets[-1] if self.buckets else 0
        self.scratch_slot = scratch_slot
        spec, dev, dtype, n = model.spec, model.device, model.dtype, self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), scratch_slot, dtype=torch.int64, device=dev)
        self.h = torch.zeros(n, spec.hidden_size, dtype=dtype, device=dev)
        self.x = torch.zeros(n, spec.hidden_size, dtype=dtype, device=dev)
        self.q = torch.zeros(n, spec.num_heads, spec.head_dim, dtype=dtype, device=dev)
        self.attn = torch.zeros(n, spec.q_size, dtype=dtype, device=dev)
        self.out = torch.zeros(n, spec.hidden_size, dtype=dtype, device=dev)
        self._host = torch.zeros(3, n, dtype=torch.int64, pin_memory=True)       # ids, positions, slots
        self._host_np = self._host.numpy()
        self._graphs: dict[tuple[int, bool], list[torch.cuda.CUDAGraph]] = {}
        self._pool = torch.cuda.graph_pool_handle() if n else None

    @property
    def enabled(self) -> bool:
        return bool(self.buckets) and self.model.all_reduce is None

    @property
    def num_captured(self) -> int:
        """Graph pieces captured so far (every bucket, base and LoRA)."""
        return sum(len(g) for g in self._graphs.values())

    def bucket_for(self, num_tokens: int) -> int | None:
        if not self.enabled:
            return None
        for b in self.buckets:
            if b >= num_tokens:
                return b
        return None

    def run(self, input_ids: list[int], positions: list[int], meta: AttentionMetadata | PrefillMetadata,
            token_slots: list[int],
            lora: LoraBackend | None) -> torch.Tensor:
        """Final hidden states [T, H] of the step (a view of a static buffer: read it before the next run)."""
        n = len(input_ids)
        bucket = self.bucket_for(n)
        if bucket is None:
            raise ValueError(f"a step of {n} tokens has no prefill graph bucket (largest {self.max_tokens})")
        key = (bucket, lora is not None)
        if key not in self._graphs:
            self._graphs[key] = self._capture(bucket, lora)
        self._fill(input_ids, positions, meta.slot_mapping, bucket)
        if lora is not None:
            lora.prepare(torch.tensor(token_slots + [NO_ADAPTER] * (bucket - n), dtype=torch.int32))
        pieces = self._graphs[key]
        model, spec = self.model, self.model.spec
        pieces[0].replay()
        for i, (k_cache, v_cache) in enumerate(self.kv_caches):
            paged_attention(self.q[:n], None, None, k_cache, v_cache, meta, model.scale,
                            out=self.attn[:n].view(n, spec.num_heads, spec.head_dim))
            pieces[i + 1].replay()
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

    def _fill(self, input_ids: list[int], positions: list[int], slot_mapping: torch.Tensor, bucket: int) -> None:
        """The step's ids and positions (padding: 0) and KV slots (padding: the scratch slot)."""
        n = len(input_ids)
        self._host_np[0, :n] = input_ids
        self._host_np[1, :n] = positions
        self._host_np[0:2, n:bucket] = 0
        self._host_np[2, n:bucket] = self.scratch_slot
        self.input_ids[:bucket].copy_(self._host[0, :bucket], non_blocking=True)
        self.positions[:bucket].copy_(self._host[1, :bucket], non_blocking=True)
        self.slot_mapping[n:bucket].copy_(self._host[2, n:bucket], non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping)                     # already on the device

    def _pieces(self, bucket: int, lora: LoraBackend | None) -> list:
        """The bucket's pieces as closures over the static buffers, in replay order."""
        model, kv, b = self.model, self.kv_caches, bucket
        ids, pos, slots = self.input_ids[:b], self.positions[:b], self.slot_mapping[:b]
        h, x, q, attn, out = self.h[:b], self.x[:b], self.q[:b], self.attn[:b], self.out[:b]
        num_layers = len(model.weights.layers)

        def first() -> None:
            torch.index_select(model.weights.embed, 0, ids, out=h)
            model.attention_in(0, None, h, x, pos, slots, kv, q, lora)

        def middle(i: int):
            def piece() -> None:
                pending = model.attention_out_mlp(i - 1, attn, h, x, lora)
                if i < num_layers:
                    model.attention_in(i, pending, h, x, pos, slots, kv, q, lora)
                else:
                    model.final_norm(pending, h, out)
            return piece

        return [first] + [middle(i) for i in range(1, num_layers + 1)]

    def _capture(self, bucket: int, lora: LoraBackend | None) -> list[torch.cuda.CUDAGraph]:
        """One graph per piece, captured on all-padding inputs after one eager run of each (which compiles
        the Triton kernels and settles lazy allocations outside the capture)."""
        self._fill([], [], self.slot_mapping[:0], bucket)
        if lora is not None:
            lora.prepare(torch.zeros(bucket, dtype=torch.int32))      # slot 0: the kernels' real code paths
        return [capture(piece, self._pool)[0] for piece in self._pieces(bucket, lora)]
