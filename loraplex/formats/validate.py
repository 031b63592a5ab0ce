"""Validation of a converted adapter against a base model, at the door.

Checks (each failure a specific `AdapterError` naming the row and what was
expected): rows present; weights dtype storable; module id in the table and
enabled; layer in range; `1 <= rank <= max_lora_rank`; no duplicate
`(module, layer)`; the row is long enough for `A [rank, in]` + `B [out, rank]`
of the module's real in/out features; everything after them is zero padding
(non-zero values there mean the rows were built for other shapes); no NaN/Inf
(also after conversion to the storage dtype); total bytes within the limit.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from loraplex.formats.adapter import Adapter
from loraplex.formats.errors import (AdapterTooLargeError, BaseModelMismatchError, DtypeError,
                                     DuplicateRowError, EmptyAdapterError, LayerOutOfRangeError,
                                     ModuleNotEnabledError, NonFiniteError, PaddingError, RankError,
                                     RowShapeError, UnknownModuleError)
from loraplex.formats.model_spec import ModelSpec
from loraplex.formats.modules import MODULE_NAMES, SERVED_MODULE_IDS
from loraplex.formats.tensors import STORAGE_DTYPES, cast_adapter


def _row_shapes(adapter: Adapter, spec: ModelSpec, max_lora_rank: int,
                enabled: frozenset[int]) -> list[tuple[int, int]]:
    """Per-row (in, out) features, checking ids, layers, ranks, duplicates and lengths."""
    width = int(adapter.weights.shape[1])
    seen: dict[tuple[int, int], int] = {}
    in_out: list[tuple[int, int]] = []
    for i, (module_id, layer, rank) in enumerate(adapter.config.tolist()):
        if module_id not in MODULE_NAMES:
            raise UnknownModuleError(f"module id {module_id} is not in the module table "
                                     f"(0-{max(MODULE_NAMES)})", row=i)
        name = MODULE_NAMES[module_id]
        if module_id not in enabled:
            raise ModuleNotEnabledError(f"module {name} (id {module_id}) is not enabled on this "
                                        f"server (enabled ids: {sorted(enabled)})", row=i)
        if not 0 <= layer < spec.num_layers:
            raise LayerOutOfRangeError(f"{name}: layer {layer} is outside [0, {spec.num_layers}) "
                                       "of the base model", row=i)
        if not 1 <= rank <= max_lora_rank:
            why = ("a rank is at least 1" if rank < 1 else
                   f"{max_lora_rank} is the server's largest (--max-lora-rank of `loraplex serve` and the services; "
                   "start them with a larger one to take this adapter)")
            raise RankError(f"{name} layer {layer}: rank {rank} is outside [1, {max_lora_rank}]: {why}", row=i)
        if (module_id, layer) in seen:
            raise DuplicateRowError(f"{name} layer {layer} already appears in row "
                                    f"{seen[(module_id, layer)]}", row=i)
        seen[(module_id, layer)] = i
        try:
            shape = spec.module_shape(module_id)
        except KeyError as e:
            raise ModuleNotEnabledError(str(e.args[0]), row=i) from None
        need = rank * (shape.in_features + shape.out_features)
        if need > width:
            raise RowShapeError(f"{name} layer {layer} rank {rank}: A [{rank}, {shape.in_features}] "
                                f"+ B [{shape.out_features}, {rank}] need {need} values but rows "
                                f"have {width}", row=i)
        in_out.append((shape.in_features, shape.out_features))
    return in_out


def _first_bad_row(mask: torch.Tensor) -> tuple[int, int] | None:
    """(row, column) of the first True in a [N, W] mask, or None."""
    if not bool(mask.any()):
        return None
    row = int(mask.any(dim=1).nonzero()[0, 0])
    return row, int(mask[row].nonzero()[0, 0])


def _all_finite(w: torch.Tensor) -> bool:
    # one reduction instead of an [N, W] mask: max(|w|) is NaN or Inf iff some value is
    return w.numel() == 0 or bool(torch.isfinite(w.abs().amax()))


def _check_finite(w: torch.Tensor) -> None:
    """NonFiniteError naming the first row and column holding NaN or Inf."""
    if not _all_finite(w):
        bad = _first_bad_row(~torch.isfinite(w))
        assert bad is not None
        raise NonFiniteError(f"{w[bad].item()} at column {bad[1]}", row=bad[0])


def _check_values(adapter: Adapter, in_out: list[tuple[int, int]]) -> None:
    w = adapter.weights
    _check_finite(w)
    ranks = adapter.config[:, 2].tolist()
    for row, (rank, (fin, fout)) in enumerate(zip(ranks, in_out)):
        used = rank * (fin + fout)
        tail = w[row, used:]
        if tail.numel() and bool(tail.any()):
            module_id, layer, _ = adapter.config[row].tolist()
            column = used + int(tail.nonzero()[0, 0])
            raise PaddingError(f"{MODULE_NAMES[module_id]} layer {layer} rank {rank} uses "
                               f"{used} values (A [{rank}, {fin}] + B [{fout}, {rank}]) but "
                               f"column {column} after them is non-zero: the rows were built for "
                               "other shapes, or the padding is garbage", row=row)


def validate(adapter: Adapter, spec: ModelSpec, max_lora_rank: int, *,
             enabled_module_ids: Iterable[int] = SERVED_MODULE_IDS,
             dtype: str | torch.dtype | None = None, max_bytes: int | None = None,
             fingerprint: str | None = None, check_values: bool = True) -> Adapter:
    """Checks `adapter` against `spec`; returns it with `in_out` filled, the fingerprint set,
    and (if `dtype` is given) converted to that storage dtype.

    `check_values=False` skips the pass over the values (NaN/Inf, zero padding): for rows a
    converter has just written into zero-filled memory and checked row by row itself."""
    fp = fingerprint if fingerprint is not None else spec.fingerprint
    if adapter.metadata.fingerprint and adapter.metadata.fingerprint != fp:
        raise BaseModelMismatchError(f"adapter was validated for base model "
                                     f"{adapter.metadata.fingerprint}, this server runs {fp}")
    if adapter.num_rows == 0:
        raise EmptyAdapterError("the adapter has no rows")
    if adapter.weights.dtype not in STORAGE_DTYPES.values():
        raise DtypeError(f"weights dtype {adapter.weights.dtype} is not float16, bfloat16 or float32")
    if adapter.weights.dim() != 2 or adapter.weights.shape[0] != adapter.num_rows:
        raise RowShapeError(f"weights shape {list(adapter.weights.shape)} does not match "
                            f"{adapter.num_rows} config rows")
    in_out = _row_shapes(adapter, spec, max_lora_rank, frozenset(enabled_module_ids))
    if check_values:
        _check_values(adapter, in_out)
    out = cast_adapter(adapter, dtype) if dtype is not None else adapter
    if max_bytes is not None and out.num_bytes > max_bytes:
        raise AdapterTooLargeError(f"adapter is {out.num_bytes} bytes, over the limit of {max_bytes}")
    out = Adapter(config=out.config, weights=out.weights, in_out=tuple(in_out), metadata=out.metadata)
    return out.with_metadata(fingerprint=fp)


def check_consistent(adapter: Adapter) -> Adapter:
    """Checks that need no base model, for tools that write adapters without one (`loraplex convert`).

    No NaN/Inf anywhere; where the reader knows each row's shapes (PEFT), every
    layer of a module has the same A [rank, in] / B [out, rank] features, and
    nothing but zeros follows them. Returns the adapter unchanged.
    """
    if not adapter.in_out:
        _check_finite(adapter.weights)
        return adapter
    features: dict[int, tuple[int, int, int]] = {}   # module id -> (in, out, first layer with them)
    for row, ((module_id, layer, rank), (fin, fout)) in enumerate(zip(adapter.config.tolist(), adapter.in_out)):
        first = features.setdefault(module_id, (fin, fout, layer))
        if first[:2] != (fin, fout):
            raise RowShapeError(
                f"{MODULE_NAMES.get(module_id, module_id)} layer {layer} has A [{rank}, {fin}] and "
                f"B [{fout}, {rank}], but layer {first[2]} of the same module has in {first[0]} / out "
                f"{first[1]}: every layer of a module must have the model's features", row=row)
    _check_values(adapter, list(adapter.in_out))
    return adapter
