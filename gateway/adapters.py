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

The host cache's answers (a name's task id and version, a task id's version)
are kept for `ttl_s` and answer later requests without a call; callers that
find an answer stale share one call per name or task id. Past `ttl_s` they
remain the last known versions, served while the cache is unreachable.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, Hashable, Protocol, TypeVar

from loraplex.errors import (AlreadyExistsError, FailedPreconditionError, InvalidArgumentError, NotFoundError,
                             ResourceExhaustedError, UnavailableError)
from loraplex.formats import (Adapter, AdapterError, AdapterMetadata, AdapterTooLargeError,
                              BaseModelMismatchError, ModelSpec, adapter_from_tensors, validate)
from loraplex.tensor_proto import tensor_from_proto
from loraplex.v1 import common_pb2

log = logging.getLogger(__name__)

K = TypeVar("K", int, str)
V = TypeVar("V")


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


class KeptAnswers(Generic[K, V]):
    """The host cache's last answer per key, fresh for `ttl_s` seconds of `clock`.

    An answer older than that is still kept: it is the last known one, for when
    the cache cannot be reached. Callers that find no fresh answer share one
    call per flight key (`ask`). Of two answers, the one asked for later is
    kept. `drop_where` also detaches the calls in flight: their answers still
    reach their callers but are not kept, and later callers start a new call
    (an unload during a call must not be undone by its answer).
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._kept: dict[K, tuple[V, float]] = {}        # key -> (answer, when it was asked for)
        self._asking: dict[Hashable, asyncio.Task[V | None]] = {}
        self._epoch = 0                                  # bumped by every drop

    def fresh(self, key: K) -> V | None:
        """The answer for `key` if it was asked for less than `ttl_s` ago."""
        kept = self._kept.get(key)
        if kept is None or self._clock() - kept[1] >= self._ttl_s:
            return None
        return kept[0]

    def last(self, key: K) -> V | None:
        """The last answer for `key`, however old."""
        kept = self._kept.get(key)
        return None if kept is None else kept[0]

    def keep(self, key: K, answer: V | None, asked_at: float | None = None) -> None:
        """Records the cache's answer for `key` (None: it has none), unless a later-asked one is kept."""
        asked_at = self._clock() if asked_at is None else asked_at
        kept = self._kept.get(key)
        if kept is not None and kept[1] > asked_at:
            return
        if answer is None:
            self._kept.pop(key, None)
        else:
            self._kept[key] = (answer, asked_at)

    def drop_where(self, match: Callable[[K, V], bool]) -> None:
        """Forgets every answer `match`es, and detaches the calls in flight."""
        self._epoch += 1
        self._asking.clear()
        self._kept = {k: kept for k, kept in self._kept.items() if not match(k, kept[0])}

    async def ask(self, key: K, call: Callable[[], Awaitable[V | None]], *, flight: Hashable | None = None,
                  share: bool = True) -> V | None:
        """`call()`'s answer, kept under `key`. With `share` (and a nonzero ttl), a call in flight for
        `flight` (default: `key`) answers this caller too."""
        if not share or self._ttl_s <= 0:
            return await self._call_and_keep(key, call)
        flight = key if flight is None else flight
        task = self._asking.get(flight)
        if task is None:
            task = asyncio.ensure_future(self._call_and_keep(key, call))
            self._asking[flight] = task
            task.add_done_callback(lambda t: self._call_done(flight, t))
        # shielded: a caller that goes away leaves the call running for the others
        return await asyncio.shield(task)

    async def _call_and_keep(self, key: K, call: Callable[[], Awaitable[V | None]]) -> V | None:
        epoch, asked_at = self._epoch, self._clock()
        answer = await call()
        if epoch == self._epoch:
            self.keep(key, answer, asked_at)
        return answer

    def _call_done(self, flight: Hashable, task: asyncio.Task[V | None]) -> None:
        if self._asking.get(flight) is task:
            del self._asking[flight]
        if not task.cancelled():
            task.exception()    # retrieved here: every caller may have gone away


class AdapterResolver:
    """Turns LoraSpecs into ResolvedLoras, caching inline adapters on first use.

    The host cache's answers are reused for `ttl_s` seconds (0: every request asks); LOAD_MODE_ALWAYS
    always asks. `clock` is the monotonic clock those seconds are read from.
    """

    def __init__(self, store: AdapterStore, model_spec: ModelSpec, *, ttl_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0 seconds, got {ttl_s}")
        self._store = store
        self._spec = model_spec
        # Versions the cache confirmed: fresh ones answer at once; older ones keep adapters already in
        # use serving while the cache is down (the compute service holds them); new adapters need the cache.
        self._versions: KeptAnswers[int, str] = KeptAnswers(ttl_s, clock)
        self._names: KeptAnswers[str, tuple[int, str]] = KeptAnswers(ttl_s, clock)

    def forget(self, task_id: int | None, name: str = "") -> None:
        """Drops what this gateway remembers of a loaded, unloaded or evicted adapter."""
        self._versions.drop_where(lambda t, _version: t == task_id)
        self._names.drop_where(lambda n, answer: n == name or answer[0] == task_id)

    async def resolve_again(self, spec: common_pb2.LoraSpec, stale: ResolvedLora,
                            what: str = "lora") -> ResolvedLora:
        """`spec` resolved by the host cache itself, after compute found no adapter at `stale`'s version."""
        self.forget(stale.task_id, spec.name)
        return await self.resolve(spec, what)

    def last_known(self, spec: common_pb2.LoraSpec) -> ResolvedLora | None:
        """What `resolve(spec)` answered last, when its answer is no longer fresh (so `resolve` would ask
        the host cache); None when nothing is known, the answer is still fresh (`resolve` answers at once),
        or the spec must always ask (LOAD_MODE_ALWAYS). A request may start on compute at this guess while
        the cache confirms it (`gateway.generation`), so a warm adapter's first token does not wait for
        the host cache's round trip."""
        if spec.load_mode == common_pb2.LOAD_MODE_ALWAYS:
            return None
        if spec.name:
            if spec.HasField("weights") or self._names.fresh(spec.name) is not None:
                return None
            kept = self._names.last(spec.name)
            if kept is None or (spec.HasField("task_id") and spec.task_id != kept[0]):
                return None
            return ResolvedLora(kept[0], kept[1], spec.name)
        if not spec.HasField("task_id") or self._versions.fresh(spec.task_id) is not None:
            return None
        version = self._versions.last(spec.task_id)
        return None if version is None else ResolvedLora(spec.task_id, version)

    async def _cached_version(self, task_id: int) -> str | None:
        version = self._versions.fresh(task_id)
        if version is not None:
            return version
        try:
            return await self._versions.ask(task_id, lambda: self._store.cached_version(task_id))
        except UnavailableError:
            version = self._versions.last(task_id)
            if version is None:
                raise
            log.warning("host cache unavailable: serving task id %d at its last known version", task_id)
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
        self._versions.keep(task_id, info.version)
        log.info("cached inline adapter task_id=%d version=%s (%d bytes)", task_id, info.version, adapter.num_bytes)
        return ResolvedLora(task_id, info.version)

    async def _resolve_name(self, spec: common_pb2.LoraSpec, what: str) -> ResolvedLora:
        if spec.HasField("weights"):
            raise InvalidArgumentError(f"{what}: give either a name or inline weights with a task_id, not "
                                       "both (use LoadLora to store inline weights under a name)")
        task_id, version = await self._name_answer(spec.name, spec.load_mode)
        if spec.HasField("task_id") and spec.task_id != task_id:
            raise InvalidArgumentError(f"{what}: name {spec.name!r} is task id {task_id}, "
                                       f"not {spec.task_id}; give one of them")
        return ResolvedLora(task_id, version, spec.name)

    async def _name_answer(self, name: str, mode: int) -> tuple[int, str]:
        """(task id, version) of `name`: kept if fresh (except under ALWAYS), else the cache's answer."""
        always = mode == common_pb2.LOAD_MODE_ALWAYS
        kept = None if always else self._names.fresh(name)
        if kept is not None:
            return kept
        try:
            answer = await self._names.ask(name, lambda: self._store.resolve_name(name, mode), flight=(name, mode),
                                           share=not always)
        except UnavailableError:
            kept = self._names.last(name)
            if kept is None or always:
                raise
            log.warning("host cache unavailable: serving %r at its last known version", name)
            return kept
        assert answer is not None    # resolve_name raises NotFoundError rather than answer None
        return answer
