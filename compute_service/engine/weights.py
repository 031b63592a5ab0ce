"""Builds the model's fused weights from Hugging Face-named tensors, and the base-model fingerprint.

With `keep_quantized` and a source that has `quantized(prefix)` (see `quant_formats/source.py`),
projections stored quantized become `QuantLinear`s (q/k/v and gate/up fused when their parts agree);
the fingerprint hashes the same slices of the source's dense (float32) tensors either way, so it equals
the dequantized load's and converted adapters keep matching.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Callable

import torch

from compute_service.engine.errors import ModelLoadError
from compute_service.engine.linear import Linear
from compute_service.engine.mlp_order import fused_rows, mlp_order
from compute_service.engine.model import LayerWeights, ModelWeights
from compute_service.engine.quant_linear import QuantLinear
from compute_service.engine.quantized import QuantizedWeight
from compute_service.engine.spec import ModelSpec

# get(name) -> float tensor as stored in the checkpoint, or None when absent.
TensorSource = Callable[[str], "torch.Tensor | None"]


def build_weights(spec: ModelSpec, get: TensorSource, dtype: torch.dtype,
                  device: torch.device, *, keep_quantized: bool = False,
                  order_mlp: bool = False) -> tuple[ModelWeights, str]:
    """Reads every tensor through `get`, fuses q/k/v and gate/up, casts; returns (weights, fingerprint).

    `order_mlp` (one device; a tensor-parallel rank's source orders its shards itself): where down is kept
    quantized act-order, gate/up's rows take its stored order and down drops its perm (`mlp_order.py`; the
    caller's pool must then `follow_orders`)."""
    hasher = _Fingerprint(spec)
    fmt = getattr(get, "format_name", None)       # set by sources of quantized checkpoints
    quantized = getattr(get, "quantized", None) if keep_quantized and fmt else None
    summary = None
    if quantized is not None:
        from compute_service.engine.quant_formats.summary import QuantSummary
        summary = QuantSummary(fmt)

    def need(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, the config implies {shape}")
        return t

    def opt(name: str, shape: tuple[int, ...], present: bool) -> torch.Tensor | None:
        return need(name, shape) if present else None

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    def cast_opt(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else cast(t)

    def fuse(parts: list[tuple[str, tuple[int, int]]]) -> tuple[QuantizedWeight | None, str]:
        return _fused_quantized(quantized, parts, device) if quantized is not None else (None, "")

    def project(parts: list[tuple[str, tuple[int, int]]], bias: torch.Tensor | None,
                rows: torch.Tensor | None = None,
                fused: tuple[QuantizedWeight | None, str] | None = None,
                stored_order: bool = False) -> Linear | QuantLinear:
        """One (fused) projection from its parts' HF prefixes and [out, in] shapes; `rows`: its output rows
        in this order; `fused`: `fuse(parts)` already read; `stored_order`: an act-order weight that reads x in
        its stored order (for the summary)."""
        qw, why_dense = fuse(parts) if fused is None else fused
        if rows is not None and bias is not None:
            bias = bias[rows.to(bias.device)]
        if qw is not None:
            layer: Linear | QuantLinear = QuantLinear(qw if rows is None else qw.select_rows(rows), cast_opt(bias),
                                                      device)
        else:
            # each part cast first: a source with a work device gives its dequantized parts there, others
            # stay on the host (GGUF: Q8_0 gate, F16 up)
            dense = [cast(need(p + ".weight", shape)) for p, shape in parts]
            weight = dense[0] if len(dense) == 1 else torch.cat(dense)
            layer = Linear(weight if rows is None else weight[rows.to(weight.device)].contiguous(), cast_opt(bias))
        if summary is not None:
            summary.add(" + ".join(p.removeprefix("model.") for p, _ in parts), layer, why_dense, stored_order)
        return layer

    def first_columns(parts: list[tuple[str, tuple[int, int]]]) -> torch.Tensor:
        """[N, :8] as the source's dense tensors (before the cast), whether or not the layer is kept quantized:
        a dequantization of one's own could differ in a bit (GGUF Q4_0 gives -0.0 where q * d - 8 * d is +0.0)."""
        return torch.cat([need(p + ".weight", shape)[:, :8].cpu() for p, shape in parts])

    s = spec
    hid, q, kv, inter = s.hidden_size, s.q_size, s.kv_size, s.intermediate_size
    embed = need("model.embed_tokens.weight", (s.vocab_size, hid))
    hasher.add("embed", embed[:8])
    layers = []
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        qkv_parts = [(p + "self_attn.q_proj", (q, hid)), (p + "self_attn.k_proj", (kv, hid)),
                     (p + "self_attn.v_proj", (kv, hid))]
        qkv_bias = None
        if s.qkv_bias:
            qkv_bias = torch.cat([need(p + "self_attn.q_proj.bias", (q,)), need(p + "self_attn.k_proj.bias", (kv,)),
                                  need(p + "self_attn.v_proj.bias", (kv,))])
        gate_up_parts = [(p + "mlp.gate_proj", (inter, hid)), (p + "mlp.up_proj", (inter, hid))]
        gate_up_bias = None
        if s.mlp_bias:
            gate_up_bias = torch.cat([need(p + "mlp.gate_proj.bias", (inter,)), need(p + "mlp.up_proj.bias", (inter,))])
        qkv = project(qkv_parts, qkv_bias)
        if i in (0, s.num_layers - 1):
            hasher.add(f"qkv{i}", first_columns(qkv_parts))
        down_parts = [(p + "mlp.down_proj", (hid, inter))]
        down_qw, why_down = fuse(down_parts)
        order = mlp_order(down_qw) if order_mlp else None
        if order is not None:            # act arrives in down's stored order
            down_qw = dataclasses.replace(down_qw, perm=None)
        layers.append(LayerWeights(
            input_norm=cast(need(p + "input_layernorm.weight", (hid,))),
            qkv=qkv,
            o=project([(p + "self_attn.o_proj", (hid, q))], opt(p + "self_attn.o_proj.bias", (hid,), s.o_bias)),
            post_norm=cast(need(p + "post_attention_layernorm.weight", (hid,))),
            gate_up=project(gate_up_parts, gate_up_bias, None if order is None else fused_rows(order, 2)),
            down=project(down_parts, opt(p + "mlp.down_proj.bias", (hid,), s.mlp_bias), fused=(down_qw, why_down),
                         stored_order=order is not None),
            mlp_order=None if order is None else order.to(device),
        ))
    norm = need("model.norm.weight", (hid,))
    hasher.add("norm", norm)
    embed_c = cast(embed)
    if s.tie_word_embeddings:
        lm_head = embed_c
    else:
        head = need("lm_head.weight", (s.vocab_size, hid))
        hasher.add("lm_head", head[:8])
        lm_head = cast(head)
    weights = ModelWeights(embed=embed_c, layers=layers, norm=cast(norm), lm_head=lm_head)
    if summary is not None:
        summary.log(dtype, device)
    return weights, hasher.hexdigest()


def _fused_quantized(quantized: Callable[[str], QuantizedWeight | None], parts: list[tuple[str, tuple[int, int]]],
                     device: torch.device) -> tuple[QuantizedWeight | None, str]:
    """The parts' quantized weights stacked, or (None, why) to build it dense: some part is stored dense,
    they differ in bits, group size or act-order input order, or (on CUDA) the kernel cannot hold the group
    size."""
    qws = [quantized(prefix) for prefix, _ in parts]
    for qw, (prefix, shape) in zip(qws, parts):
        if qw is not None and qw.shape != shape:
            raise ModelLoadError(f"quantized {prefix!r} has shape {qw.shape}, the config implies {shape}")
    if all(qw is None for qw in qws):
        return None, "stored dense"
    kinds = {(qw.bits, qw.group_size) for qw in qws if qw is not None}
    if any(qw is None for qw in qws) or len(kinds) > 1:
        return None, "fused parts stored " + "/".join(
            "dense" if qw is None else f"{qw.bits}-bit g{qw.group_size}" for qw in qws)
    if not all(qw.same_input_order(qws[0]) for qw in qws if qw is not None):
        return None, "fused parts in different act-order input orders"
    fused = QuantizedWeight.cat([qw for qw in qws if qw is not None])
    if device.type == "cuda":
        from kernels.quant_pack import check_packable

        try:
            check_packable(*fused.shape, fused.bits, fused.group_size)
        except ValueError as exc:
            return None, f"the kernel cannot hold it: {exc}"
    return fused, ""


class _Fingerprint:
    """sha256 of the architecture and dims plus a few tensors' float32 bytes (dtype-independent)."""

    def __init__(self, spec: ModelSpec) -> None:
        dims = {k: getattr(spec, k) for k in ("architecture", "num_layers", "hidden_size", "num_heads",
                                              "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")}
        self._h = hashlib.sha256(json.dumps(dims, sort_keys=True).encode())

    def add(self, name: str, t: torch.Tensor) -> None:
        self._h.update(name.encode())
        self._h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())

    def hexdigest(self) -> str:
        return self._h.hexdigest()[:32]
