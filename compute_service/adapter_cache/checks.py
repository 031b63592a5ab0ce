"""Structural checks of an adapter against the base model, with no pass over its values.

The host cache validated every value at the door (DESIGN.md "Validation");
here only what the GPU cache relies on is re-checked on the host, in
microseconds, and NaN/Inf are checked again on the device after the upload, so
loading never costs a CPU pass over hundreds of megabytes.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from compute_service.adapter_cache.layout import module_features
from compute_service.engine.errors import InvalidAdapterError
from compute_service.engine.spec import ModelSpec
from loraplex.errors import FailedPreconditionError
from loraplex.formats.adapter import Adapter
from loraplex.formats.modules import MODULE_NAMES


def check_structure(adapter: Adapter, spec: ModelSpec, max_lora_rank: int,
                    fingerprint: str | None = None) -> Adapter:
    """Returns the adapter with `in_out` filled from the model; raises naming the first bad row.

    `fingerprint` is the base-model fingerprint adapters are validated against (the
    host cache stamps it into their metadata): one made for another model is refused.
    """
    made_for = adapter.metadata.fingerprint
    if fingerprint and made_for and made_for != fingerprint:
        raise FailedPreconditionError(
            f"adapter was validated for base model {made_for}, this compute service runs {fingerprint}: "
            "point the host cache and the compute service at the same --model")
    config = np.asarray(adapter.config)
    if config.ndim != 2 or config.shape[1] != 3:
        raise InvalidAdapterError(f"adapter config must be [N, 3] rows [module_id, layer_idx, rank], got {config.shape}")
    w = adapter.weights
    if w.ndim != 2 or w.shape[0] != config.shape[0] or not w.is_floating_point():
        raise InvalidAdapterError(f"adapter weights must be floating point [N={config.shape[0]}, W], "
                                  f"got {w.dtype} {tuple(w.shape)}")
    feats = dict(module_features(spec))
    feats[0] = (spec.hidden_size, spec.q_size + 2 * spec.kv_size)
    seen: set[tuple[int, int]] = set()
    in_out = []
    for i, (module_id, layer, rank) in enumerate(config.tolist()):
        where = f"row {i} (module {module_id} {MODULE_NAMES.get(module_id, '?')}, layer {layer}, rank {rank})"
        if module_id not in feats:
            raise InvalidAdapterError(f"{where}: module id not served (served: {sorted(feats)})")
        if not 0 <= layer < spec.num_layers:
            raise InvalidAdapterError(f"{where}: layer out of range [0, {spec.num_layers})")
        if not 1 <= rank <= max_lora_rank:
            raise InvalidAdapterError(f"{where}: rank must be in [1, max_lora_rank={max_lora_rank}]")
        targets = [(m, layer) for m in ((1, 2, 3) if module_id == 0 else (module_id,))]
        if any(t in seen for t in targets):
            raise InvalidAdapterError(f"{where}: module/layer given twice")
        seen.update(targets)
        fio = feats[module_id]
        if adapter.in_out and tuple(adapter.in_out[i]) != fio:
            raise InvalidAdapterError(f"{where}: (in, out) features {tuple(adapter.in_out[i])} do not match "
                                      f"the model's {fio}")
        if rank * (fio[0] + fio[1]) > w.shape[1]:
            raise InvalidAdapterError(f"{where}: needs {rank * (fio[0] + fio[1])} values, rows hold {w.shape[1]}")
        in_out.append(fio)
    return replace(adapter, in_out=tuple(in_out))
