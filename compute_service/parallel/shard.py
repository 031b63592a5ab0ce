"""Which slice of each weight a tensor-parallel rank holds, and the model it then runs.

Column-parallel layers (q, k, v, gate, up) keep a slice of their output features, row-parallel
ones (o, down) the matching slice of their input features, so a rank runs an ordinary, smaller
decoder (`local_spec`) whose o and down outputs are partial sums, all-reduced once each per layer.
Query heads and MLP columns split evenly. KV heads split evenly when tp divides them; when tp is a
multiple of them (tp > num_kv_heads), each rank holds the one KV head its query heads read, so a
KV head is replicated on tp / num_kv_heads ranks. Embedding, norms and head stay whole.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from compute_service.engine.errors import ModelLoadError
from compute_service.engine.quantized import QuantizedWeight
from compute_service.engine.spec import ModelSpec
from compute_service.engine.weights import TensorSource, _Fingerprint


@dataclass(frozen=True)
class Shard:
    """Feature ranges [start, end) of one rank, in the whole model's numbering."""

    tp: int
    rank: int
    q: tuple[int, int]        # query features (heads * head_dim)
    kv: tuple[int, int]       # key (and value) features of the local KV heads
    inter: tuple[int, int]    # MLP intermediate features


def shard_for(spec: ModelSpec, tp: int, rank: int) -> Shard:
    """The rank's slices; refuses a model whose heads or MLP do not split over `tp`."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside tensor-parallel size {tp}")
    h, kvh, d, inter = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    if h % tp or inter % tp:
        raise ModelLoadError(f"tensor-parallel size {tp} must divide num_heads {h} and intermediate_size {inter}")
    if kvh % tp == 0:
        kv_first, kv_count = rank * (kvh // tp), kvh // tp
    elif tp % kvh == 0:
        kv_first, kv_count = rank // (tp // kvh), 1          # replicated on tp / kvh ranks
    else:
        raise ModelLoadError(f"tensor-parallel size {tp} and num_kv_heads {kvh}: one must divide the other")
    hl, il = h // tp, inter // tp
    return Shard(tp, rank, (rank * hl * d, (rank + 1) * hl * d), (kv_first * d, (kv_first + kv_count) * d),
                 (rank * il, (rank + 1) * il))


def local_spec(spec: ModelSpec, shard: Shard) -> ModelSpec:
    """The decoder one rank runs: its heads, KV heads and MLP columns."""
    d = spec.head_dim
    return replace(spec, num_heads=(shard.q[1] - shard.q[0]) // d, num_kv_heads=(shard.kv[1] - shard.kv[0]) // d,
                   intermediate_size=shard.inter[1] - shard.inter[0])


def sharded_source(spec: ModelSpec, shard: Shard, get: TensorSource, order_mlp: bool = False) -> TensorSource:
    """A tensor source of the rank's slices under the checkpoint's names (for `build_weights`).

    Row-parallel biases (o, down) are added once, after the all-reduce: rank 0 keeps them, the
    others read zeros. A source with `rows(name, a, b)` / `columns(name, a, b)` (safetensors, GGUF)
    is read a slice at a time; others are read whole, then sliced.
    A source of a quantized checkpoint (`quantized(prefix)`, see `quant_formats/source.py`) keeps
    that view too, sliced the same way: whole rows of codes, or whole groups of in features (a
    column range that cuts a group, or any range of an act-order weight, gives None, and the projection
    is read dense); with
    `quantized_rows` / `quantized_columns` (GGUF) only the slice is read.
    `order_mlp` (a load that keeps quantized weights so): where down is act-order and the rank's range of
    intermediate features holds whole groups, the rank keeps down's stored columns of that range, quantized,
    and gate's and up's rows of the same features, in that order (`compute_service.engine.mlp_order`);
    `local.mlp_orders()` then names each layer's order, by which adapters are split (`lora_split`).
    """
    rows = {"q_proj": shard.q, "k_proj": shard.kv, "v_proj": shard.kv, "gate_proj": shard.inter,
            "up_proj": shard.inter}
    cols = {"o_proj": shard.q, "down_proj": shard.inter}

    read_rows = getattr(get, "rows", None)          # a source that reads slices from disk
    read_cols = getattr(get, "columns", None)

    quantized = getattr(get, "quantized", None)
    q_rows = getattr(get, "quantized_rows", None)        # kept quantized, a slice read from disk (GGUF)
    q_cols = getattr(get, "quantized_columns", None)
    orders: dict[str, torch.Tensor | None] = {}          # layer prefix -> down's order this rank follows
    read_downs: dict[str, QuantizedWeight | None] = {}   # whole downs read for their order, not yet sliced

    def read_down(layer: str) -> QuantizedWeight | None:
        """The layer's whole down (quantized), its order noted where this rank can follow it."""
        qw = quantized(layer + "mlp.down_proj") if quantized is not None else None
        a, b = shard.inter
        follow = order_mlp and qw is not None and qw.perm is not None and not (a % qw.group_size or b % qw.group_size)
        orders[layer] = qw.perm if follow else None
        return qw

    def rank_features(name: str) -> torch.Tensor | None:
        """The whole model's intermediate features this rank holds, in its order, for an MLP tensor `name`
        of a layer whose down's order it follows; None otherwise (the range `shard.inter` in the model's order)."""
        if not order_mlp or quantized is None or q_cols is not None or ".mlp." not in name:
            return None
        layer = name[: name.index("mlp.")]
        if layer not in orders:
            read_downs[layer] = read_down(layer)
        order = orders[layer]
        return None if order is None else order[shard.inter[0]: shard.inter[1]]

    def local(name: str) -> torch.Tensor | None:
        proj, kind = name.split(".")[-2:]
        if not name.startswith("model.layers.") or (proj not in rows and proj not in cols):
            return get(name)
        features = rank_features(name) if proj in ("gate_proj", "up_proj", "down_proj") else None
        if features is not None and not (proj == "down_proj" and kind == "bias"):
            t = get(name)
            if t is None:
                return None
            features = features.to(t.device)
            return t[features] if proj in rows else t[:, features]
        if proj in rows:
            a, b = rows[proj]
            if read_rows is not None:
                return read_rows(name, a, b)  # type: ignore[no-any-return]
            t = get(name)
            return None if t is None else t[a:b]
        if kind == "bias":
            t = get(name)
            return t if t is None or shard.rank == 0 else torch.zeros_like(t)
        a, b = cols[proj]
        if read_cols is not None:
            return read_cols(name, a, b)  # type: ignore[no-any-return]
        t = get(name)
        return None if t is None else t[:, a:b]

    def whole_down(prefix: str) -> QuantizedWeight | None:
        """A layer's whole down, read once (`rank_features` may have read it for its order already)."""
        layer = prefix[: prefix.index("mlp.")]
        return read_downs.pop(layer) if layer in read_downs else read_down(layer)

    def local_quantized(prefix: str) -> QuantizedWeight | None:
        proj = prefix.split(".")[-1]
        features = rank_features(prefix) if proj in ("gate_proj", "up_proj", "down_proj") else None
        if features is not None and proj == "down_proj":      # its stored columns of the rank's range
            qw = whole_down(prefix)
            assert qw is not None
            return _stored_columns(qw, *shard.inter)
        if features is not None:
            qw = quantized(prefix)
            return None if qw is None else qw.select_rows(features)
        if prefix.startswith("model.layers.") and proj in rows and q_rows is not None:
            return q_rows(prefix, *rows[proj])  # type: ignore[no-any-return]
        if prefix.startswith("model.layers.") and proj in cols and q_cols is not None:
            return q_cols(prefix, *cols[proj])  # type: ignore[no-any-return]
        if quantized is None:
            return None
        qw = whole_down(prefix) if prefix.startswith("model.layers.") and proj == "down_proj" else quantized(prefix)
        if qw is None or not prefix.startswith("model.layers."):
            return qw
        if proj in rows:
            return qw.rows(*rows[proj])
        a, b = cols[proj]
        g = qw.group_size
        if a % g or b % g or qw.perm is not None:     # act-order: a rank's channels are spread over the groups
            return None
        return _stored_columns(qw, a, b)

    def mlp_orders() -> list[torch.Tensor | None]:
        """Each layer's down order this rank's MLP shards follow (None: the model's order)."""
        return [orders.get(f"model.layers.{i}.") for i in range(spec.num_layers)]

    local.mlp_orders = mlp_orders                               # type: ignore[attr-defined]
    if quantized is not None:
        local.quantized = local_quantized                       # type: ignore[attr-defined]
        local.format_name = getattr(get, "format_name", None)   # type: ignore[attr-defined]
    return local


def _stored_columns(qw: QuantizedWeight, start: int, end: int) -> QuantizedWeight:
    """Stored in-feature columns [start, end) of `qw` (whole groups: a row-parallel shard), read in that order."""
    g = qw.group_size
    return QuantizedWeight(qw.q[:, start:end].contiguous(), qw.scales[:, start // g: end // g].contiguous(),
                           qw.offsets[:, start // g: end // g].contiguous(), qw.bits, g)


def whole_fingerprint(spec: ModelSpec, get: TensorSource) -> str:
    """The base-model fingerprint of the whole model (as `build_weights` computes it at tp=1), so
    adapters validated against the single-GPU service fit the tensor-parallel one."""
    h = _Fingerprint(spec)

    def need(name: str) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}")
        return t

    h.add("embed", need("model.embed_tokens.weight")[:8])
    for i in sorted({0, spec.num_layers - 1}) if spec.num_layers else []:
        p = f"model.layers.{i}.self_attn."
        # on the host: a GPU load's source gives quantized projections on the GPU, dense ones where it reads them
        h.add(f"qkv{i}", torch.cat([need(p + f"{m}_proj.weight")[:, :8].cpu() for m in "qkv"]))
    h.add("norm", need("model.norm.weight"))
    if not spec.tie_word_embeddings:
        h.add("lm_head", need("lm_head.weight")[:8])
    return h.hexdigest()
