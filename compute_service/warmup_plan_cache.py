"""The warm-up plan kept on disk: a restart with the same code, versions, GPU and settings skips the dry runs.

`warmup_plan.make_plan` dry-runs the LoRA backend at every token count a step can have (seconds of host time
on a large step budget), yet its result is a pure function of the code, the library versions, the GPU and the
settings. `PlanKey` names all of them; the plan is kept as JSON, named after the sha256 of the key, in
`loraplex-warmup-plans/` beside Triton's kernel cache (`$TRITON_CACHE_DIR`, else `~/.triton/cache`), which a
deployment already keeps across restarts. A missing, unreadable or malformed file is a miss: the plan is
computed and written again, atomically. The cache never fails a start: a write error is a warning.
`LORAPLEX_WARMUP_PLAN_CACHE=0` turns it off (always compute, never write). It applies on CUDA only, where the
plan records launch keys; elsewhere every token count is one class and there is nothing to save.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from compute_service.warmup_plan import LaunchClass, LaunchRecorder, WarmupPlan, make_plan

log = logging.getLogger(__name__)
ENABLE_ENV = "LORAPLEX_WARMUP_PLAN_CACHE"
SUBFOLDER = "loraplex-warmup-plans"
SOURCE_PACKAGES = ("kernels", "compute_service")     # the kernels' choices and the backend that launches them
# Environment switches of the compute process that change which kernels a step launches (docs/deploy.md), beside
# kernels.pdl.ENV and kernels.quant_h2.ENV (`switch_parts`); these three are read in compute_service/engine/model.py.
ENGINE_SWITCHES = ("LORAPLEX_LORA_FIRST", "LORAPLEX_LORA_OVERLAP", "LORAPLEX_LORA_OVERLAP_TOKENS")


@dataclass(frozen=True)
class PlanKey:
    """Everything a warm-up plan depends on: two starts with equal keys get equal plans."""

    sources: str                             # sha256 of every .py file of SOURCE_PACKAGES
    triton_version: str
    torch_version: str
    python_version: str
    device_name: str
    num_sms: int
    capability: tuple[int, int]
    spec: str                                # repr of the ModelSpec
    max_num_batched_tokens: int
    decode_buckets: tuple[int, ...]
    launched_tokens: tuple[int, ...]         # the count a step of T tokens launches with, T = 1..max
    adapters: tuple[tuple[int, int], ...]    # the synthetic adapters' (slot id, rank)
    dtype: str
    backend: str                             # the LoRA backend's class
    quantized: str                           # the quantized base projections (`warmup_plan.describe_quantized`)
    pool: tuple[int, ...]                    # the pool geometry the kernels see (slots, layers, modules, rank, ...)
    switches: str                            # the kernel switches as set in the environment (`switch_parts`)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def local_parts(device: torch.device) -> dict[str, Any]:
    """The key parts this process and `device` (CUDA) fix: the sources, the library versions, the GPU, the
    kernel switches of its environment."""
    import triton

    props = torch.cuda.get_device_properties(device)
    return {"sources": package_sources(), "triton_version": triton.__version__, "torch_version": torch.__version__,
            "python_version": platform.python_version(), "device_name": props.name,
            "num_sms": props.multi_processor_count, "capability": (props.major, props.minor),
            "switches": switch_parts()}


def switch_names() -> tuple[str, ...]:
    """The environment switches that change which kernels a step launches."""
    from kernels.pdl import ENV as PDL_ENV
    from kernels.quant_h2 import ENV as FP16_PAIRS_ENV
    from kernels.quant_matmul import TILE_TMA_ENV, TMA_ENV
    from kernels.quant_wgmma import ENV as ASYNC_DOTS_ENV
    from kernels.quant_wgmma import ONE_ROW_ENV, SYNC_ENV
    from compute_service.engine.quant_linear import DEFER_SPLIT_ENV

    return (PDL_ENV, *ENGINE_SWITCHES, FP16_PAIRS_ENV, TMA_ENV, TILE_TMA_ENV, ASYNC_DOTS_ENV, SYNC_ENV, ONE_ROW_ENV,
            DEFER_SPLIT_ENV)


def switch_parts() -> str:
    """The switches as this process has them, e.g. "LORAPLEX_PDL=0;LORAPLEX_LORA_FIRST=;..." (unset: empty)."""
    return ";".join(f"{name}={os.environ.get(name, '')}" for name in switch_names())


def package_sources() -> str:
    """`source_digest` of the installed SOURCE_PACKAGES (found through their imports, wherever installed)."""
    import importlib

    return source_digest(Path(importlib.import_module(name).__file__ or "").parent for name in SOURCE_PACKAGES)


def source_digest(roots: Iterable[Path]) -> str:
    """sha256 over every .py file under `roots`: each file's path (relative to its root's parent) and text."""
    h = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            h.update(path.relative_to(root.parent).as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def plan_cache_enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1").strip() != "0"


def plan_cache_applies(device: torch.device) -> bool:
    """Whether a start on `device` keeps its plan: CUDA with launch keys recorded, and the cache not turned off."""
    return device.type == "cuda" and LaunchRecorder.available() and plan_cache_enabled()


def plan_cache_dir() -> Path:
    """`loraplex-warmup-plans/` in Triton's cache folder: its own setting where it has one, else
    `$TRITON_CACHE_DIR`, else `~/.triton/cache`."""
    try:
        from triton import knobs

        base = str(knobs.cache.dir)
    except (ImportError, AttributeError):
        base = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    return Path(base) / SUBFOLDER


@dataclass(frozen=True)
class PlanCache:
    """One start's place in the cache: `folder/<key>.json`."""

    folder: Path
    key: str

    @property
    def path(self) -> Path:
        return self.folder / f"{self.key}.json"

    def load(self) -> WarmupPlan | None:
        """The saved plan, or None when there is none or it cannot be read (a miss either way)."""
        try:
            data = json.loads(self.path.read_text())
            return _plan_from(data, self.key)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("warm-up: cached plan %s unreadable (%s): computing it again", self.path, exc)
            return None

    def save(self, plan: WarmupPlan) -> bool:
        """Writes `plan` atomically (a temporary file renamed over the old one); False, and a warning, on error."""
        tmp = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{self.key}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                os.fchmod(fd, 0o644)        # readable as Triton's own cache files are, not only by this user
                json.dump({"key": self.key, **asdict(plan)}, f)
            os.replace(tmp, self.path)
            return True
        except OSError as exc:
            log.warning("warm-up: could not save the plan to %s (%s): the next start computes it again",
                        self.path, exc)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return False


def _plan_from(data: Any, key: str) -> WarmupPlan:
    """A WarmupPlan from a saved file's JSON; ValueError where it is not one saved under `key`."""
    if not isinstance(data, dict) or data.get("key") != key:
        raise ValueError("not a plan saved under this key")
    values = {}
    for f in fields(WarmupPlan):
        value = data.get(f.name)
        ok = _is_int(value) if f.name == "num_classes" else isinstance(value, list) and all(map(_is_int, value))
        if not ok:
            raise ValueError(f"field {f.name!r} is {value!r}")
        values[f.name] = value
    return WarmupPlan(**values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class PlanLookup:
    """A plan and where it came from: read from `path`, or computed (and saved to `path`, unless None)."""

    plan: WarmupPlan
    from_cache: bool
    path: Path | None
    seconds: float

    def describe(self) -> str:
        """For the warm-up's log line."""
        if self.from_cache:
            return f"plan from cache {self.path} ({self.plan.num_classes} launch classes)"
        saved = f"plan saved to {self.path}" if self.path is not None else "plan not saved"
        return f"{self.plan.num_classes} launch classes in {self.seconds:.1f} s ({saved})"


def cached_plan(max_num_batched_tokens: int, decode_buckets: Iterable[int], launched_tokens: Callable[[int], int],
                make_classify: Callable[[], Callable[[int], LaunchClass]], cache: PlanCache | None) -> PlanLookup:
    """`make_plan` of these arguments, read from `cache` where it holds it, else computed and saved there.

    `make_classify()` builds the classify function (a spare backend and its buffers): called on a miss only.
    No `cache`, or the cache turned off (`LORAPLEX_WARMUP_PLAN_CACHE=0`): always computed, never saved."""
    t = time.perf_counter()
    if cache is not None and not plan_cache_enabled():
        cache = None
    if cache is not None and (plan := cache.load()) is not None:
        return PlanLookup(plan, True, cache.path, time.perf_counter() - t)
    plan = make_plan(max_num_batched_tokens, decode_buckets, make_classify(), launched_tokens)
    path = cache.path if cache is not None and cache.save(plan) else None
    return PlanLookup(plan, False, path, time.perf_counter() - t)
