"""Domain records the backends store next to adapter bytes: headers, sources, stats.

They serialize to JSON so the Redis backend can keep them as plain strings
that every replica (and a person with redis-cli) can read.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class AdapterRecord:
    """Everything about a cached adapter except its weight bytes."""

    task_id: int
    version: str                        # content hash of config + weights
    config: tuple[tuple[int, int, int], ...]  # rows [module_id, layer_idx, rank]
    dtype: str                          # "float16" | "bfloat16" | "float32"
    shape: tuple[int, int]              # weights [N, W]
    num_bytes: int                      # bytes of weights
    fingerprint: str = ""               # base model it was validated against
    source: str = "inline"              # a path, "inline", or "prefetch:<dir>"
    name: str = ""                      # its name, if it has one
    original_format: str = ""           # "peft", "npy", "safetensors", "inline"
    extra: dict[str, str] = field(default_factory=dict)  # conversion record
    in_out: tuple[tuple[int, int], ...] = ()  # per row (in_features, out_features)
    stored_unix_s: float = 0.0          # when it entered the cache

    def config_array(self) -> np.ndarray:
        return np.asarray(self.config, dtype=np.int32).reshape(-1, 3)

    @property
    def max_rank(self) -> int:
        return max((r[2] for r in self.config), default=0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "AdapterRecord":
        d = json.loads(text)
        d["config"] = tuple(tuple(int(v) for v in row) for row in d["config"])
        d["shape"] = tuple(d["shape"])
        d["in_out"] = tuple(tuple(p) for p in d["in_out"])
        return cls(**d)


@dataclass(frozen=True)
class SourceEntry:
    """Where a task id's adapter can be reloaded from after eviction."""

    task_id: int
    path: str        # file or folder on the cache host
    name: str = ""   # llgtrt-style name ("" for prefetch-folder adapters)
    kind: str = ""   # "root", "prefetch" or "path"
    signature: str = ""  # sizes and mtimes of its files when loaded: a change means a new version

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "SourceEntry":
        return cls(**json.loads(text))


@dataclass(frozen=True)
class CacheStats:
    """Counters over the cache's life (shared by replicas with Redis)."""

    bytes_used: int
    bytes_total: int
    num_adapters: int
    hits: int
    misses: int
    evictions: int


@dataclass(frozen=True)
class ListedAdapter:
    """A cached adapter and when it was last used."""

    record: AdapterRecord
    last_used_unix_s: float
