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


def sharded_source(spec: ModelSpec, shard: Shard, get: TensorSource) -> TensorSource:
    """A tensor source of the rank's slices under the checkpoint's names (for `build_weights`).

    Row-parallel biases (o, down) are added once, after the all-reduce: rank 0 keeps them, the
    others read zeros. A source with `rows(name, a, b)` / `columns(name, a, b)` (safetensors, GGUF)
    is read a slice at a time; others are read whole, then sliced.
    A source of a quantized checkpoint (`quantized(prefix)`, see `quant_formats/source.py`) keeps
    that view too, sliced the same way: whole rows of codes, or whole groups of in features (a
    column range that cuts a group, or any range of an act-order weight, gives None, and the projection
    is read dense); with
    `quantized_rows` / `quantized_columns` (GGUF) only the slice is read.
    """
    rows = {"q_proj": shard.q, "k_proj": shard.kv, "v_proj": shard.kv, "gate_proj": shard.inter,
            "up_proj": shard.inter}
    cols = {"o_proj": shard.q, "down_proj": shard.inter}

    read_rows = getattr(get, "rows", None)          # a source that reads slices from disk
    read_cols = getattr(get, "columns", None)

    def local(name: str) -> torch.Tensor | None:
        proj, kind = name.split(".")[-2:]
        if not name.startswith("model.layers.") or (proj not in rows and proj not in cols):
            return get(name)
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

    quantized = getattr(get, "quantized", None)
    q_rows = getattr(get, "quantized_rows", None)        # kept quantized, a slice read from disk (GGUF)
    q_cols = getattr(get, "quantized_columns", None)

    def local_quantized(prefix: str) -> QuantizedWeight | None:
        proj = prefix.split(".")[-1]
        if prefix.startswith("model.layers.") and proj in rows and q_rows is not None:
            return q_rows(prefix, *rows[proj])  # type: ignore[no-any-return]
        if prefix.startswith("model.layers.") and proj in cols and q_cols is not None:
            return q_cols(prefix, *cols[proj])  # type: ignore[no-any-return]
        qw = quantized(prefix) if quantized is not None else None
        if qw is None or not prefix.startswith("model.layers."):
            return qw
        if proj in rows:
            return qw.rows(*rows[proj])
        a, b = cols[proj]
        g = qw.group_size
        if a % g or b % g or qw.perm is not None:     # act-order: a rank's channels are spread over the groups
            return None
        return QuantizedWeight(qw.q[:, a:b].contiguous(), qw.scales[:, a // g: b // g].contiguous(),
                               qw.offsets[:, a // g: b // g].contiguous(), qw.bits, g)

    if quantized is not None:
        local.quantized = local_quantized                       # type: ignore[attr-defined]
        local.format_name = getattr(get, "format_name", None)   # type: ignore[attr-defined]
    return local


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
