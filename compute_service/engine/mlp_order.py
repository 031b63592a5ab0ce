"""The MLP's intermediate features kept in an act-order down projection's stored order.

An act-order checkpoint (GPTQ `desc_act`, compressed-tensors `actorder`) stores down's input channels sorted by
group (`QuantizedWeight.perm`: stored column j is the model's intermediate feature perm[j]), so its kernels read
act = silu(gate) * up in that order. The intermediate features are the MLP's own: gate's and up's output rows
and down's input columns, and nothing else reads them. So the load keeps gate's and up's rows in that order
(`fused_rows`) and down's columns as stored (its perm dropped): the same function, whose SwiGLU computes act
already in down's order, as for a checkpoint without act-order. No scatter or gather of act, no launch of its
own for act's slice sums, no second copy of act for the LoRA launches (`LlamaModel._ordered_x` is left to
q/k/v, gate/up and o, whose inputs come from the residual stream or the attention and cannot be reordered).

The adapters follow: their gate and up B rows and their down A columns are taken in each layer's order as they
are packed into the pool (`PagedAdapterSlots.follow_orders`, `take_intermediate`).

Under tensor parallelism a rank's MLP shards are cut from the features in down's stored order instead (its
down columns stay whole groups, quantized), and adapters are split by the same order before they reach the
rank's pool (`parallel.shard.sharded_source`'s `order_mlp`, `parallel.lora_split.split_row`).
LORAPLEX_MLP_ORDER=0 turns both off (A/B runs).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.env_switch import env_int

if TYPE_CHECKING:
    from compute_service.engine.quantized import QuantizedWeight

MLP_ORDER_ENV = "LORAPLEX_MLP_ORDER"


def mlp_order_enabled() -> bool:
    """LORAPLEX_MLP_ORDER (unset or 1 by default; 0 keeps the model's order and leaves down its gather)."""
    return env_int(MLP_ORDER_ENV, lambda v: v in (0, 1), "0 or 1") != 0


def mlp_order(down: QuantizedWeight | None) -> torch.Tensor | None:
    """The order to keep a layer's intermediate features in: down's act-order perm (int64 [I]), or None."""
    return None if down is None else down.perm


def fused_rows(order: torch.Tensor, parts: int) -> torch.Tensor:
    """Row index of a projection stacking `parts` [I]-row parts (gate, up), each in `order`."""
    size = order.numel()
    return torch.cat([order + k * size for k in range(parts)])


def orders_table(orders: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor | None:
    """[L, I] int64 on `device`: each layer's order (the model's own where it has none), or None when no layer
    has one."""
    given = [o for o in orders if o is not None]
    if not given:
        return None
    size = given[0].numel()
    own = torch.arange(size, dtype=torch.int64, device=device)
    return torch.stack([own if o is None else o.to(device=device, dtype=torch.int64) for o in orders])


def take_intermediate(t: torch.Tensor, layers: np.ndarray, table: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` ([n, ...], row k an adapter row of layer layers[k]) with its intermediate dimension `dim` taken in
    that layer's order: out[k, .., j, ..] = t[k, .., table[layers[k], j], ..]."""
    index = table[torch.from_numpy(np.asarray(layers, dtype=np.int64)).to(table.device)]       # [n, I]
    shape = [t.shape[0]] + [1] * (t.dim() - 1)
    shape[dim] = t.shape[dim]
    return torch.gather(t, dim, index.view(shape).expand(t.shape))


def in_model_order(name: str, weight: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """A layer's projection `name` weight ([out, in], as its `dequantize()` gives it) with the intermediate
    features back in the model's order, given the layer's `mlp_order` (tests, inspection)."""
    if order is None or name not in ("gate_up", "down"):
        return weight
    order = order.to(weight.device)
    if name == "gate_up":
        return torch.empty_like(weight).index_copy_(0, fused_rows(order, weight.shape[0] // order.numel()), weight)
    return torch.empty_like(weight).index_copy_(1, order, weight)
