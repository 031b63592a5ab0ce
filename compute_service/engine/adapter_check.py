"""Checks a converted adapter against the loaded base model before it takes a slot."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from compute_service.engine.errors import InvalidAdapterError
from compute_service.engine.spec import ModelSpec
from loraplex.formats.adapter import Adapter
from loraplex.formats.modules import MODULE_NAMES, SERVED_MODULE_IDS, module_shape


def check_adapter(adapter: Adapter, spec: ModelSpec, max_lora_rank: int) -> Adapter:
    """Returns the adapter with `in_out` filled from the model; raises naming the first bad row."""
    config = np.asarray(adapter.config)
    if config.ndim != 2 or config.shape[1] != 3:
        raise InvalidAdapterError(f"adapter config must be [N, 3] rows [module_id, layer_idx, rank], got {config.shape}")
    if adapter.weights.ndim != 2 or adapter.weights.shape[0] != config.shape[0]:
        raise InvalidAdapterError(
            f"adapter weights must be [N={config.shape[0]}, W], got {tuple(adapter.weights.shape)}")
    if not adapter.weights.is_floating_point():
        raise InvalidAdapterError(f"adapter weights must be floating point, got {adapter.weights.dtype}")
    in_out = []
    seen = set()
    for i, (module_id, layer, rank) in enumerate(config.tolist()):
        where = f"row {i} (module {module_id} {MODULE_NAMES.get(module_id, '?')}, layer {layer}, rank {rank})"
        if module_id not in SERVED_MODULE_IDS:
            raise InvalidAdapterError(f"{where}: module id not served by a Llama-family model "
                                      f"(served: {list(SERVED_MODULE_IDS)})")
        if not 0 <= layer < spec.num_layers:
            raise InvalidAdapterError(f"{where}: layer out of range [0, {spec.num_layers})")
        if not 1 <= rank <= max_lora_rank:
            raise InvalidAdapterError(f"{where}: rank must be in [1, max_lora_rank={max_lora_rank}]")
        if (module_id, layer) in seen:
            raise InvalidAdapterError(f"{where}: duplicate module/layer row")
        seen.add((module_id, layer))
        shape = module_shape(module_id, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
                             num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                             intermediate_size=spec.intermediate_size)
        fio = (shape.in_features, shape.out_features)
        if adapter.in_out and tuple(adapter.in_out[i]) != fio:
            raise InvalidAdapterError(f"{where}: (in, out) features {tuple(adapter.in_out[i])} do not match "
                                      f"the model's {fio}")
        width = rank * (fio[0] + fio[1])
        if width > adapter.weights.shape[1]:
            raise InvalidAdapterError(f"{where}: needs {width} values, the weights rows hold {adapter.weights.shape[1]}")
        if not torch.isfinite(adapter.weights[i, :width]).all():
            raise InvalidAdapterError(f"{where}: weights contain NaN or Inf")
        in_out.append(fio)
    return replace(adapter, in_out=tuple(in_out))
