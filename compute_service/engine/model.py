"""A Llama-family decoder written for serving: flat token batches over a paged KV cache.

Covers Llama 2/3, Mistral, Qwen2 and SmolLM2: RMSNorm, RoPE (plain or Llama-3
scaled), grouped-query attention, SwiGLU, tied or untied head, optional
q/k/v (and o, mlp) biases. q/k/v and gate/up are fused into one matmul each;
LoRA deltas are added to the fused outputs' slices by a `LoraBackend`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from compute_service.engine.attention import StepMetadata, paged_attention
from compute_service.engine.graph_capture import in_graph_forward
from compute_service.engine.linear import Linear, dense_linear
from compute_service.engine.lora_backend import LoraBackend
from compute_service.engine.quant_linear import ordered_x_enabled
from compute_service.engine.rope import RotaryEmbedding
from compute_service.engine.spec import ModelSpec
from kernels.env_switch import env_int

if TYPE_CHECKING:
    from kernels.split_sum import SplitSum

# Steps of 2 to this many tokens run their LoRA beside the base projection inside CUDA graphs. A step of
# one token runs it first instead (`_project`): its base matmul is a one-row kernel that keeps every SM reading
# weights, and adds the delta. At batch 8, on the library GEMM, 6.27 ms beside against 6.47 after (H200, 8B
# shape, rank-16 all-module adapters); at 32 / 64 tokens (a shrink and an expand launch) 4.87 / 6.95 ms beside
# against 5.32 / 7.05 after on the 4-bit base, 6.36 / 7.66 against 6.64 / 7.86 in bf16, so the bound is 64, the
# largest decode batch the benchmarks ran (bench/results/quant_decode_overlap_tokens.json).
# LORAPLEX_LORA_OVERLAP_TOKENS sets another bound (tuning).
LORA_OVERLAP_TOKENS = 64
OVERLAP_TOKENS_ENV = "LORAPLEX_LORA_OVERLAP_TOKENS"
# An act-order down projection's x from this many rows: scattered by the SwiGLU, its slice sums summed by down.
# Gathered with the sums written in the same pass below (H200, the 4-bit 8B's step with act-order, 2026-12-01,
# `bench/results/step_profile_act_order_scatter.json`: ms a step gathered / scattered, 4 rows 2.48 / 2.78,
# 16: 2.91 / 3.10, 32: 3.53 / 3.53, 64: 5.03 / 4.79; rank 16 on every module, 16: 4.74 / 4.71, 32: 5.39 / 5.17).
SCATTER_MIN_TOKENS = 32
# A layer's delta not yet added to the residual stream h: the down projection's output (a tensor, or on a
# quantized split-K kernel its partials, `kernels.split_sum.SplitSum`), and its LoRA delta where that is still
# to be added too (`LlamaModel._project`'s extra), else None.
Pending = tuple["torch.Tensor | SplitSum", "torch.Tensor | None"]


def overlap_tokens() -> int:
    """The most tokens a captured step runs its LoRA beside the base projection at: LORA_OVERLAP_TOKENS, or
    LORAPLEX_LORA_OVERLAP_TOKENS (2 or more; 1 turns the overlap off, as LORAPLEX_LORA_OVERLAP=0 does)."""
    value = env_int(OVERLAP_TOKENS_ENV, lambda v: v >= 1, "a whole number of tokens, at least 1")
    return LORA_OVERLAP_TOKENS if value is None else value


@dataclass
class LayerWeights:
    input_norm: torch.Tensor             # [H]
    qkv: Linear                          # [q + 2kv, H], bias [q + 2kv] when the model has one
    o: Linear                            # [H, q]
    post_norm: torch.Tensor              # [H]
    gate_up: Linear                      # [2I, H]
    down: Linear                         # [H, I]
    # Intermediate feature j is the model's feature mlp_order[j] (int64 [I]: gate's and up's rows and down's
    # columns kept in an act-order down's stored order, `mlp_order.py`); None: the model's order.
    mlp_order: torch.Tensor | None = None


LAYER_PROJECTIONS = ("qkv", "o", "gate_up", "down")     # LayerWeights' projections (its Linear fields), in order


@dataclass
class ModelWeights:
    embed: torch.Tensor                  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor                   # [H]
    lm_head: torch.Tensor                # [V, H] (the embedding itself when tied)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Computed in float32 and cast back before the weight, as transformers does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """Forward over a flat batch of T tokens from any number of sequences."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, max_positions: int) -> None:
        self.spec = spec
        self.weights = weights
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.rope = RotaryEmbedding(spec.head_dim, max_positions, spec.rope_theta, spec.rope_scaling, self.device)
        self.scale = spec.head_dim ** -0.5
        # Fused Triton ops (add + RMSNorm, RoPE + KV write, SwiGLU) on CUDA: decode is launch-bound there.
        self.fused = self.device.type == "cuda"
        # Tensor parallelism (`shard_over`): sums a row-parallel layer's partial output over the ranks in
        # place (o and down, LoRA delta included); None on one GPU.
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        # The same on the fused path: (x, h, weight, eps, out, slot) sums x over the ranks into h and writes
        # norm(h) to out, in one launch where it can; slots alternate 0 (o), 1 (down).
        self.reduce_add_norm: Callable[..., None] | None = None
        # Side stream for LoRA overlapped with the base projections in captured graphs (`_project`).
        overlap = os.environ.get("LORAPLEX_LORA_OVERLAP", "1") != "0"
        self._lora_stream = torch.cuda.Stream(self.device) if self.fused and overlap else None
        self._overlap_tokens = overlap_tokens()
        self._ordered_x_on = ordered_x_enabled()     # act-order x written in the projection's order (`_ordered_x`)
        # One-token steps: the LoRA runs first, into these float32 zeros, and the base projection's one-row
        # kernel adds it (`_project`); every kernel that adds it leaves it zero again.
        self._lora_delta: torch.Tensor | None = None
        if self.fused and os.environ.get("LORAPLEX_LORA_FIRST", "1") != "0":
            width = max(spec.q_size + 2 * spec.kv_size, 2 * spec.intermediate_size, spec.hidden_size)
            self._lora_delta = torch.zeros(width, dtype=torch.float32, device=self.device)

    def shard_over(self, group: Any) -> None:
        """Tensor parallelism over `group` (a `compute_service.parallel.group.TensorParallelGroup` of 2+
        ranks): this model holds one rank's shard, and its row-parallel outputs are summed over the ranks."""
        self.all_reduce = group.all_reduce
        self.reduce_add_norm = group.reduce_add_rms_norm

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lora: LoraBackend | None = None) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, H] (after the last norm)."""
        if self.fused:
            return self._forward_fused(input_ids, positions, meta, kv_caches, lora)
        spec = self.spec
        h = self.weights.embed[input_ids]                                     # [T, H]
        for i, lw in enumerate(self.weights.layers):
            residual = h
            x = rms_norm(h, lw.input_norm, spec.rms_norm_eps)
            qkv = lw.qkv(x)                                                 # [T, q + 2kv]
            q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
            if lora is not None:
                lora.apply(i, "qkv", x, [q, k, v])
            t = x.shape[0]
            q = self.rope.apply(q.reshape(t, spec.num_heads, spec.head_dim), positions)
            k = self.rope.apply(k.reshape(t, spec.num_kv_heads, spec.head_dim), positions)
            v = v.reshape(t, spec.num_kv_heads, spec.head_dim)
            attn = paged_attention(q, k, v, kv_caches[i][0], kv_caches[i][1], meta, self.scale)
            attn = attn.reshape(t, spec.q_size)
            o = lw.o(attn)
            if lora is not None:
                lora.apply(i, "o", attn, [o])
            if self.all_reduce is not None:
                self.all_reduce(o)
            h = residual + o
            residual = h
            x = rms_norm(h, lw.post_norm, spec.rms_norm_eps)
            gate_up = lw.gate_up(x)                                         # [T, 2I]
            gate, up = gate_up.split([spec.intermediate_size, spec.intermediate_size], dim=-1)
            if lora is not None:
                lora.apply(i, "gate_up", x, [gate, up])
            act = F.silu(gate) * up
            down = lw.down(act)
            if lora is not None:
                lora.apply(i, "down", act, [down])
            if self.all_reduce is not None:
                self.all_reduce(down)
            h = residual + down
        return rms_norm(h, self.weights.norm, spec.rms_norm_eps)

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       meta: StepMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       lora: LoraBackend | None) -> torch.Tensor:
        """Same math as `forward`, ~9 launches per layer: the residual add rides in the next norm.

        Built from the same parts as the forward that `prefill_graphs.PrefillGraphs` captures."""
        spec = self.spec
        h = self.weights.embed[input_ids]                                     # [T, H] residual stream
        t = h.shape[0]
        x = torch.empty_like(h)
        pending: Pending | None = None                                        # delta not yet added to h
        for i in range(len(self.weights.layers)):
            q = torch.empty(t, spec.num_heads, spec.head_dim, dtype=h.dtype, device=h.device)
            self.attention_in(i, pending, h, x, positions, meta.slot_mapping, kv_caches, q, lora)
            attn = paged_attention(q, None, None, *kv_caches[i], meta, self.scale).reshape(t, spec.q_size)
            pending = self.attention_out_mlp(i, attn, h, x, lora)
        out = torch.empty_like(h)
        self.final_norm(pending, h, out)
        return out

    def attention_in(self, i: int, pending: Pending | None, h: torch.Tensor, x: torch.Tensor,
                     positions: torch.Tensor, slot_mapping: torch.Tensor,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor,
                     lora: LoraBackend | None) -> None:
        """Layer i up to its attention: h += pending (the previous layer's delta, if any), x = norm(h),
        q/k/v with LoRA, RoPE into q [T, heads, D] and k/v into the cache at `slot_mapping` (CUDA)."""
        from kernels.rms_norm import add_rms_norm       # Triton: imported on first use (interpreter flag)
        from kernels.rope_cache import rope_and_cache

        spec, lw = self.spec, self.weights.layers[i]
        perm, xp, model_x = self._ordered_x("qkv", lw.qkv, x, lora)
        sums = self._norm_sums(lw.qkv, x, perm is not None)
        if pending is None:
            add_rms_norm(h, None, lw.input_norm, spec.rms_norm_eps, xp, sums=sums, perm=perm, model_out=model_x)
        else:
            self._add_norm(pending[0], h, lw.input_norm, xp, 1, sums, pending[1], perm, model_x)
        qkv, extra = self._project(i, "qkv", lw.qkv, x, lora, [spec.q_size, spec.kv_size, spec.kv_size], sums,
                                   defer=True, xp=xp)
        k_cache, v_cache = kv_caches[i]
        rope_and_cache(qkv, positions, slot_mapping, self.rope.cos, self.rope.sin, q, k_cache, v_cache, extra)

    def attention_out_mlp(self, i: int, attn: torch.Tensor, h: torch.Tensor, x: torch.Tensor,
                          lora: LoraBackend | None) -> Pending:
        """Layer i after its attention (attn [T, q]): h += o; x = norm(h); returns the MLP's delta
        (added to h by the next layer's `attention_in` or by `final_norm`; under tensor parallelism
        this rank's partial delta, summed over the ranks there), with its LoRA delta where that is
        still to be added (`_project`'s extra)."""
        from kernels.silu_mul import silu_mul

        spec, lw = self.spec, self.weights.layers[i]
        local = self.reduce_add_norm is None         # o's and down's outputs reach a kernel of this rank
        o, extra = self._project(i, "o", lw.o, attn, lora, [spec.hidden_size], defer=local)
        perm, xp, model_x = self._ordered_x("gate_up", lw.gate_up, x, lora)
        sums = self._norm_sums(lw.gate_up, x, perm is not None)
        self._add_norm(o, h, lw.post_norm, xp, 0, sums, extra, perm, model_x)     # h += o; x = norm(h)
        gate_up, extra = self._project(i, "gate_up", lw.gate_up, x, lora, [spec.intermediate_size] * 2, sums,
                                       defer=True, xp=xp)
        act = torch.empty(h.shape[0], spec.intermediate_size, dtype=h.dtype, device=h.device)
        perm, actp, model_act = self._ordered_x("down", lw.down, act, lora)
        # Act-order from SCATTER_MIN_TOKENS rows: the SwiGLU reads gate/up in order and scatters act in down's
        # order, and down sums act's slices in a launch of its own; below, the SwiGLU gathers its inputs to write
        # act and its sums in one pass (docs/quantization-performance.md, "Act-order").
        scatter = perm is not None and act.shape[0] >= SCATTER_MIN_TOKENS
        sums = None if scatter else self._x_sums(lw.down, act, perm is not None)
        silu_mul(gate_up, actp, sums, extra, perm, model_act, None if perm is None else lw.down.input_perm_inverse)
        return self._project(i, "down", lw.down, act, lora, [spec.hidden_size], sums, defer=local, xp=actp)

    def writes_sums(self, name: str) -> bool:
        """Whether the kernel that writes projection `name`'s x (LAYER_PROJECTIONS) writes its slice sums too
        (`_x_sums`), in the fused forward: the norms before q/k/v and gate/up (not under tensor parallelism)
        and the SwiGLU before down; o's x comes from attention, so o's call computes them itself."""
        if not self.fused or name == "o":
            return False
        return name == "down" or self.reduce_add_norm is None

    def _x_sums(self, linear: Linear, x: torch.Tensor, ordered: bool = False) -> torch.Tensor | None:
        """A buffer for the slice sums of x ([T, K]) that `linear` reads on its quantized pair-codes path
        (`QuantLinear.sums_width`; `ordered`: x written in its stored order, `_ordered_x`), for the kernel that
        writes x to fill (no launch of their own between the two); None where it reads none."""
        width = linear.sums_width(x.shape[0], x.dtype, ordered)
        if not width:
            return None
        return torch.empty(x.shape[0], x.shape[1] // width, dtype=torch.float32, device=x.device)

    def _norm_sums(self, linear: Linear, x: torch.Tensor, ordered: bool = False) -> torch.Tensor | None:
        """`_x_sums` for an x that a norm writes: none under tensor parallelism (its all-reduce + norm writes
        no sums; the projection computes them itself)."""
        return None if self.reduce_add_norm is not None else self._x_sums(linear, x, ordered)

    def writes_ordered(self, name: str, linear: Linear) -> bool:
        """Whether the kernel that writes projection `name`'s x writes it in `linear`'s stored channel order
        (`_ordered_x`): where `linear` reads x in an order of its own (act-order, `Linear.input_perm`) and that
        kernel is one that writes its sums too (`writes_sums`: the norms, not under tensor parallelism; the
        SwiGLU), unless LORAPLEX_ORDERED_X=0 (`ordered_x_enabled`)."""
        return self._ordered_x_on and linear.input_perm is not None and self.writes_sums(name)

    def _ordered_x(self, group: str, linear: Linear, x: torch.Tensor, lora: LoraBackend | None
                   ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(perm, xp, model_x) for the kernel that writes projection `group`'s input x: where it writes it in
        `linear`'s order (`writes_ordered`), its perm, a new buffer xp that receives x in that order for the
        projection, and x itself where a LoRA launch of this step reads it in the model's order (else None: x
        is not written). Otherwise (None, x, None): x as always."""
        if not self.writes_ordered(group, linear):
            return None, x, None
        reads = lora is not None and group in lora.active_groups
        return linear.input_perm, torch.empty_like(x), x if reads else None

    def _add_norm(self, delta: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                  slot: int, sums: torch.Tensor | None = None, extra: torch.Tensor | None = None,
                  perm: torch.Tensor | None = None, model_out: torch.Tensor | None = None) -> None:
        """h += delta + extra (delta summed over the ranks under tensor parallelism, where there is no extra);
        out = norm(h) * weight, and `sums` (if any) out's slice sums (`kernels.rms_norm.add_rms_norm`; `perm`,
        `model_out`: out in a projection's channel order, `_ordered_x`)."""
        from kernels.rms_norm import add_rms_norm

        if self.reduce_add_norm is not None:
            assert sums is None, "the all-reduce + norm writes no slice sums"
            assert extra is None, "under tensor parallelism a LoRA delta is added before the all-reduce"
            assert perm is None, "the all-reduce + norm writes x in the model's order"
            self.reduce_add_norm(delta, h, weight, self.spec.rms_norm_eps, out, slot)
            return
        add_rms_norm(delta, h, weight, self.spec.rms_norm_eps, out, h, sums, extra, perm, model_out)

    def _project(self, i: int, group: str, linear: Linear, x: torch.Tensor, lora: LoraBackend | None,
                 widths: list[int], x_sums: torch.Tensor | None = None, defer: bool = False,
                 xp: torch.Tensor | None = None) -> tuple[torch.Tensor | SplitSum, torch.Tensor | None]:
        """(y, extra): y = linear(x) [T, sum(widths)] plus the LoRA delta of every slice (widths: the slices'
        columns), or, where `defer` and the delta is still to be added, y without it and the delta as extra
        (y's dtype and shape) for the kernel that reads y next to add (`kernels.addend.with_extra`); else extra
        is None. `x_sums`: x's slice sums where `linear` reads them (`_x_sums`), written with x. With `defer`
        (y goes to a kernel that reads it: the norm, RoPE + cache, the SwiGLU) y may also be a split-K
        projection's partials (`kernels.split_sum.SplitSum`, which those kernels sum), wherever nothing
        adds to y in place first.

        While a CUDA graph of a small step (2 to LORA_OVERLAP_TOKENS tokens, `overlap_tokens`) is captured (and
        in the forwards that stand for one: `graph_capture.in_graph_forward`), the LoRA runs on a side stream
        into a zeroed buffer concurrently with the base projection and is added after both (by the next kernel,
        `defer`, or by an add of its own): there the LoRA kernels are bound by latency, not bytes, and the base
        matmul hides them.
        A step of one token whose projection runs a one-row kernel (`takes_addend`) launches the LoRA first,
        into float32 zeros (`_lora_delta`; backends that say `delta_first`: they always launch a kernel for
        a float32 output), and the kernel adds it: that kernel reads x and its whole
        weight before it waits for the LoRA launch (kernels/pdl.py), so the LoRA's chain of dependent
        memory round trips runs beside the weight reads instead of after them. x was written before the
        LoRA launch, which writes only the delta.

        `xp`: x in `linear`'s stored channel order (`_ordered_x`), which the base projection reads (and the LoRA x,
        in the model's order, where a LoRA launch runs); None: the projection reads x."""
        if lora is not None and group not in lora.active_groups:
            lora = None                 # no adapter of this step changes this group: the base projection alone
        ordered = xp is not None and xp is not x
        base_x = xp if ordered else x
        first = (lora is not None and self._lora_delta is not None and x.shape[0] == 1
                 and getattr(lora, "delta_first", False))
        if first and not ordered and self._ordered_x_on and linear.input_perm is not None \
                and self.reduce_add_norm is None and linear.takes_addend(x, True):
            # An act-order x that no kernel wrote in order (o's, from attention): gathered here, before the LoRA
            # launch, so that the projection can still take the delta as its addend (its early read of x then
            # follows two launches behind the gather). Not under tensor parallelism, where q/k/v and gate/up
            # gather too: not measured on two GPUs yet.
            from kernels.perm import gather_columns

            base_x, ordered = gather_columns(x, linear.input_perm), True
        if first and linear.takes_addend(base_x, ordered):
            delta = self._lora_delta[: sum(widths)].view(1, -1)
            lora.apply(i, group, x, list(delta.split(widths, dim=-1)))
            return linear(base_x, addend=delta, split_out=defer, ordered=ordered), None
        side = self._lora_stream
        kw: dict[str, Any] = {} if x_sums is None else {"x_sums": x_sums}
        if ordered:
            kw["ordered"] = True
        if lora is None or side is None or not 1 < x.shape[0] <= self._overlap_tokens or not in_graph_forward():
            y = linear(base_x, split_out=defer and lora is None, **kw)
            if lora is not None:
                lora.apply(i, group, x, list(y.split(widths, dim=-1)))
            return y, None
        main = torch.cuda.current_stream()
        delta = torch.empty(x.shape[0], sum(widths), dtype=x.dtype, device=x.device)   # main stream's memory
        side.wait_stream(main)
        with torch.cuda.stream(side):
            delta.zero_()
            lora.apply(i, group, x, list(delta.split(widths, dim=-1)))
        y = linear(base_x, beside_lora=True, split_out=defer, **kw)    # leaves room for the LoRA launch beside it
        main.wait_stream(side)
        if defer:
            return y, delta
        y.add_(delta)
        return y, None

    def final_norm(self, pending: Pending | None, h: torch.Tensor, out: torch.Tensor) -> None:
        """out = norm(h + pending) (h updated in place), or norm(h) for a model with no layers."""
        from kernels.rms_norm import add_rms_norm

        if pending is None:
            add_rms_norm(h, None, self.weights.norm, self.spec.rms_norm_eps, out)
        else:
            self._add_norm(pending[0], h, self.weights.norm, out, 1, extra=pending[1])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32 (matmul in the model dtype, as transformers)."""
        return dense_linear(hidden, self.weights.lm_head).float()
