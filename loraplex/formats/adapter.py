"""The converted adapter: the one value every loraplex service handles.

Converted form (TensorRT-LLM's LoRA tensor format, DESIGN.md "The adapter"):
- `config`  int32 `[N, 3]`, rows `[module_id, layer_idx, rank]`;
- `weights` `[N, W]` in the storage dtype; row i is `A` (`[rank, in]`,
  row-major) flattened, then `B` (`[out, rank]`, row-major) flattened, then
  zeros up to `W` (the longest row).
The LoRA scale (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA) is already
multiplied into `B`, so `delta_W = B @ A` for every row.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import numpy as np
import torch

from loraplex.formats.hashing import weights_version
from loraplex.formats.modules import MODULE_NAMES


@dataclass(frozen=True)
class AdapterRow:
    """One module-layer of an adapter, as views into the weights tensor."""

    index: int
    module_id: int
    layer_idx: int
    rank: int
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank], scale folded in


@dataclass(frozen=True)
class AdapterMetadata:
    """What travels with an adapter besides its tensors."""

    source: str = "inline"             # a path, "inline", or "prefetch:<dir>"
    fingerprint: str = ""              # base-model fingerprint it was validated against ("" = not yet)
    original_format: str = ""          # "peft", "npy", "safetensors", "inline"
    extra: dict[str, str] = field(default_factory=dict)  # conversion record (alpha, rslora, ...)


@dataclass(frozen=True)
class Adapter:
    """A converted adapter: `config` int32 [N, 3] and `weights` [N, W]."""

    config: np.ndarray       # int32 [N, 3] rows [module_id, layer_idx, rank]
    weights: torch.Tensor    # [N, W] storage dtype (float16, bfloat16 or float32), contiguous, CPU
    in_out: tuple[tuple[int, int], ...] = ()  # per row (in_features, out_features); () when unknown
    metadata: AdapterMetadata = field(default_factory=AdapterMetadata)

    @property
    def num_rows(self) -> int:
        return int(self.config.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    @property
    def num_bytes(self) -> int:
        """Bytes of the converted weights tensor (what a cache stores)."""
        return self.weights.numel() * self.weights.element_size()

    @property
    def max_rank(self) -> int:
        return int(self.config[:, 2].max()) if self.num_rows else 0

    @property
    def content_hash(self) -> str:
        """Stable hash of config and weights bytes: the adapter's version."""
        return content_hash(self.config, self.weights)

    def row_features(self, i: int) -> tuple[int, int]:
        """(in_features, out_features) of row i; needs `in_out` (set by readers/validation)."""
        if not self.in_out:
            raise ValueError("row shapes unknown: validate the adapter against a model first")
        return self.in_out[i]

    def rows(self) -> Iterator[AdapterRow]:
        """Yields every row's A and B as views (needs `in_out`)."""
        for i in range(self.num_rows):
            module_id, layer_idx, rank = (int(v) for v in self.config[i])
            fin, fout = self.row_features(i)
            row = self.weights[i]
            a = row[: rank * fin].view(rank, fin)
            b = row[rank * fin: rank * fin + fout * rank].view(fout, rank)
            yield AdapterRow(i, module_id, layer_idx, rank, a, b)

    def ranks_by_module(self) -> dict[str, tuple[int, int, int]]:
        """module name -> (num_layers, min_rank, max_rank)."""
        out: dict[str, tuple[int, int, int]] = {}
        for module_id in sorted(set(int(m) for m in self.config[:, 0])):
            ranks = self.config[self.config[:, 0] == module_id][:, 2]
            out[MODULE_NAMES.get(module_id, str(module_id))] = (len(ranks), int(ranks.min()), int(ranks.max()))
        return out

    def with_metadata(self, **changes: Any) -> "Adapter":
        return replace(self, metadata=replace(self.metadata, **changes))


def content_hash(config: np.ndarray, weights: torch.Tensor) -> str:
    """The adapter's version: a hash of dtype, shapes and bytes of config and weights (see `hashing`)."""
    data = weights.contiguous().reshape(-1).view(torch.uint8).numpy()
    return weights_version(weights.dtype, config, tuple(weights.shape), data)
