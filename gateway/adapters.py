"""Resolving a request's `LoraSpec` to a cached adapter (task id + version).

The seed semantics (TensorRT-LLM's `lora_task_id`, llgtrt's `lora_model` and
`load_lora_weights`):
- neither task id nor name: the base model;
- task id + inline weights + config: cached on first use (validated against
  the base model before anything is stored); later requests send the task id
  alone; AUTO uses the cached copy when there is one, ALWAYS replaces it,
  NEVER uses only a cached copy;
- task id alone: the cached adapter, NOT_FOUND if it is not cached;
- name: resolved by the host cache (loading it from the adapter root unless
  NEVER; reloading it under ALWAYS).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from loraplex.errors import (AlreadyExistsError, FailedPreconditionError, InvalidArgumentError, NotFoundError,
                             ResourceExhaustedError, UnavailableError)
from loraplex.formats import (Adapter, AdapterError, AdapterMetadata, AdapterTooLargeError,
                              BaseModelMismatchError, ModelSpec, adapter_from_tensors, validate)
from loraplex.tensor_proto import tensor_from_proto
from loraplex.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedLora:
    """A request entry's adapter: None task id means the base model."""

    task_id: int | None
    version: str = ""
    name: str = ""

    @property
    def is_base(self) -> bool:
        return self.task_id is None


@dataclass(frozen=True)
class StoreLimits:
    """What the host cache validates adapters against."""

    fingerprint: str
    max_lora_rank: int
    max_bytes: int


class AdapterStore(Protocol):
    """What the gateway needs of the host cache (see `gateway.cache_store`)."""

    async def cached_version(self, task_id: int) -> str | None:
        """The cached version of `task_id`, None when it is not cached."""

    async def put(self, task_id: int, adapter: Adapter, *, name: str = "",
                  replace: bool = False) -> common_pb2.AdapterInfo:
        """Stores a validated adapter; returns what was stored (with its version)."""

    async def resolve_name(self, name: str, load_mode: int) -> tuple[int, str]:
        """(task id, version) of a named adapter."""

    async def limits(self) -> StoreLimits:
        """Fingerprint, rank and size limits the cache validates against."""

    async def load_path(self, path: str, task_id: int | None, name: str,
                        replace: bool) -> common_pb2.AdapterInfo:
        """Loads an adapter from a path on the cache's host."""

    async def evict(self, task_id: int | None, name: str) -> bool:
        """Removes an adapter and forgets its name; True when something was removed."""

    async def list(self) -> tuple[list[common_pb2.AdapterInfo], int, int]:
        """(adapters, bytes used, byte budget)."""


def adapter_error(exc: AdapterError, what: str) -> Exception:
    """An adapter format/validation error as the domain error a client sees."""
    if isinstance(exc, AdapterTooLargeError):
        return ResourceExhaustedError(f"{what}: {exc}")
    if isinstance(exc, BaseModelMismatchError):
        return FailedPreconditionError(f"{what}: {exc}")
    return InvalidArgumentError(f"{what}: {exc}")


def adapter_from_spec_tensors(weights: common_pb2.Tensor, config: common_pb2.Tensor, what: str) -> Adapter:
    """Inline `weights` + `config` -> an unvalidated Adapter (shape/dtype errors as INVALID_ARGUMENT)."""
    w = tensor_from_proto(weights, f"{what} weights")
    c = tensor_from_proto(config, f"{what} config")
    try:
        return adapter_from_tensors(w, c, metadata=AdapterMetadata(source="inline", original_format="inline"))
    except AdapterError as exc:
        raise adapter_error(exc, what) from exc


class AdapterResolver:
    """Turns LoraSpecs into ResolvedLoras, caching inline adapters on first use."""

    def __init__(self, store: AdapterStore, model_spec: ModelSpec) -> None:
        self._store = store
        self._spec = model_spec
        # Last versions the cache confirmed, so adapters already in use keep serving while the
        # cache is down (the compute service holds them); new adapters need the cache.
        self._known: dict[int, str] = {}
        self._known_names: dict[str, tuple[int, str]] = {}

    def forget(self, task_id: int | None, name: str = "") -> None:
        """Drops what this gateway remembers of an unloaded adapter."""
        if task_id is not None:
            self._known.pop(task_id, None)
        self._known_names = {n: v for n, v in self._known_names.items() if n != name and v[0] != task_id}

    async def _cached_version(self, task_id: int) -> str | None:
        try:
            version = await self._store.cached_version(task_id)
        except UnavailableError:
            if task_id not in self._known:
                raise
            log.warning("host cache unavailable: serving task id %d at its last known version", task_id)
            return self._known[task_id]
        if version is None:
            self._known.pop(task_id, None)
        else:
            self._known[task_id] = version
        return version

    async def validate_inline(self, weights: common_pb2.Tensor, config: common_pb2.Tensor, what: str) -> Adapter:
        """Decodes and validates inline tensors against the base model (nothing is stored)."""
        adapter = adapter_from_spec_tensors(weights, config, what)
        limits = await self._store.limits()
        if limits.fingerprint and limits.fingerprint != self._spec.fingerprint:
            raise FailedPreconditionError(
                f"the gateway's model (fingerprint {self._spec.fingerprint}) differs from the host "
                f"cache's ({limits.fingerprint}): start both with the same --model")
        try:
            return validate(adapter, self._spec, limits.max_lora_rank, max_bytes=limits.max_bytes or None,
                            fingerprint=limits.fingerprint or None)
        except AdapterError as exc:
            raise adapter_error(exc, what) from exc

    async def resolve(self, spec: common_pb2.LoraSpec, what: str = "lora") -> ResolvedLora:
        has_task = spec.HasField("task_id")
        has_weights, has_config = spec.HasField("weights"), spec.HasField("config")
        mode = spec.load_mode
        if has_weights != has_config:
            raise InvalidArgumentError(f"{what}: inline adapters need both weights and config "
                                       f"(got only {'weights' if has_weights else 'config'})")
        if mode not in (common_pb2.LOAD_MODE_AUTO, common_pb2.LOAD_MODE_ALWAYS, common_pb2.LOAD_MODE_NEVER):
            raise InvalidArgumentError(f"{what}: unknown load_mode {mode}")
        if spec.name:
            return await self._resolve_name(spec, what)
        if not has_task:
            if has_weights:
                raise InvalidArgumentError(f"{what}: inline weights need a task_id to cache them under")
            return ResolvedLora(None)
        task_id = spec.task_id
        if has_weights and mode != common_pb2.LOAD_MODE_NEVER:
            return await self._resolve_inline(spec, task_id, what)
        if mode == common_pb2.LOAD_MODE_ALWAYS:
            raise InvalidArgumentError(f"{what}: load_mode ALWAYS reloads an adapter, so it needs weights "
                                       "and config (or a name to reload from the adapter root)")
        version = await self._cached_version(task_id)
        if version is None:
            raise NotFoundError(f"{what}: task id {task_id} is not cached; send weights and config with "
                                "it (its first request) or load it with LoadLora")
        return ResolvedLora(task_id, version)

    async def _resolve_inline(self, spec: common_pb2.LoraSpec, task_id: int, what: str) -> ResolvedLora:
        if spec.load_mode == common_pb2.LOAD_MODE_AUTO:
            version = await self._cached_version(task_id)
            if version is not None:
                # As in the seed: once cached, the task id alone identifies it; use ALWAYS to replace.
                return ResolvedLora(task_id, version)
        adapter = await self.validate_inline(spec.weights, spec.config, what)
        try:
            info = await self._store.put(task_id, adapter, replace=spec.load_mode == common_pb2.LOAD_MODE_ALWAYS)
        except AlreadyExistsError:
            # A concurrent first request cached it meanwhile: AUTO uses that copy.
            version = await self._cached_version(task_id)
            if version is None:
                raise
            return ResolvedLora(task_id, version)
        self._known[task_id] = info.version
        log.info("cached inline adapter task_id=%d version=%s (%d bytes)", task_id, info.version, adapter.num_bytes)
        return ResolvedLora(task_id, info.version)

    async def _resolve_name(self, spec: common_pb2.LoraSpec, what: str) -> ResolvedLora:
        if spec.HasField("weights"):
            raise InvalidArgumentError(f"{what}: give either a name or inline weights with a task_id, not "
                                       "both (use LoadLora to store inline weights under a name)")
        try:
            task_id, version = await self._store.resolve_name(spec.name, spec.load_mode)
        except UnavailableError:
            if spec.name not in self._known_names or spec.load_mode == common_pb2.LOAD_MODE_ALWAYS:
                raise
            task_id, version = self._known_names[spec.name]
            log.warning("host cache unavailable: serving %r at its last known version", spec.name)
        self._known_names[spec.name] = (task_id, version)
        if spec.HasField("task_id") and spec.task_id != task_id:
            raise InvalidArgumentError(f"{what}: name {spec.name!r} is task id {task_id}, "
                                       f"not {spec.task_id}; give one of them")
        return ResolvedLora(task_id, version, spec.name)
