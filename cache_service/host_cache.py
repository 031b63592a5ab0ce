"""The host cache's behaviour: puts, gets that reload named adapters, names, sources.

`HostCache` sits between the servicer (protobuf) and a backend (bytes + LRU
index). Seed semantics: an inline adapter is cached on first use and later
requests may send only its task id; once evicted it gives NOT_FOUND asking for
the weights again, while an adapter with a source on disk (adapter root,
prefetch folder, LoadPath) is reloaded transparently. A name always resolves
to the weights now on disk: files that changed since the cached load give a
new version.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from loraplex.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from loraplex.formats import ModelSpec, list_adapter_root, list_prefetch_dir
from cache_service import sources as disk
from cache_service.backend import CacheBackend, Reader
from cache_service.convert_procs import ConvertProcesses
from cache_service.metrics import CacheMetrics
from cache_service.records import AdapterRecord, CacheStats, ListedAdapter, SourceEntry
from cache_service.single_flight import SingleFlight
from cache_service.disk_loads import upload_from_disk
from cache_service.uploads import Upload, UploadClaim

log = logging.getLogger(__name__)
RELOADABLE = ("root", "prefetch", "path")


@dataclass(frozen=True)
class PutOutcome:
    """A stored (or already cached) adapter and what was evicted for it."""

    record: AdapterRecord
    evicted: list[int]
    stored: bool


# Until puts show the sizes in use, a backend that prepares memory for puts prepares it for an adapter of
# this rank on every module (bf16), the shape of the benchmarks' and many published adapters.
EXPECTED_RANK = 64
ALL_MODULES = (1, 2, 3, 4, 5, 6, 7)


def typical_adapter_bytes(spec: ModelSpec, rank: int) -> int:
    """Converted bytes of a bf16 adapter of `rank` on all seven modules of every layer: [7 L, W] rows,
    W the widest row."""
    width = max(rank * (s.in_features + s.out_features) for s in map(spec.module_shape, ALL_MODULES))
    return len(ALL_MODULES) * spec.num_layers * width * 2


class HostCache:
    """Level-1 adapter cache over one backend, validated against one base model."""

    def __init__(self, backend: CacheBackend, spec: ModelSpec, *, max_lora_rank: int,
                 lora_root: str = "", lora_prefetch_dir: str = "", metrics: CacheMetrics | None = None,
                 convert: ConvertProcesses | None = None) -> None:
        self.backend = backend
        self.spec = spec
        self.fingerprint = spec.fingerprint
        self.max_lora_rank = max_lora_rank
        self.lora_root = Path(lora_root).resolve() if lora_root else None
        self.prefetch_dir = Path(lora_prefetch_dir).resolve() if lora_prefetch_dir else None
        self.metrics = metrics or CacheMetrics(backend.stats, backend.kind)
        # Sources found by scanning this host's folders; a fallback when the
        # backend's shared registry is unreachable or was wiped (Redis restart).
        self._local_sources: dict[int, SourceEntry] = {}
        # Concurrent loads of one source share one conversion.
        self._loads = SingleFlight()
        # Worker processes that convert PEFT folders into shared memory (None: this process converts).
        self.convert = convert

    # -- puts ---------------------------------------------------------------
    def begin_upload(self, claim: UploadClaim) -> Upload:
        return Upload(self.backend, claim, self.spec, self.fingerprint, self.max_lora_rank)

    def finish_upload(self, upload: Upload, *, replace: bool, source: SourceEntry | None = None) -> PutOutcome:
        """Validates and publishes an upload; registers its name (inline names cannot reload)."""
        try:
            record = upload.finish()
            result = self.backend.commit(upload.writer, record, replace)
        except BaseException:
            upload.abort()
            raise
        if source is None and record.name:
            source = SourceEntry(record.task_id, "", record.name, "inline")
        if source is not None:
            self.backend.put_source(source)
        self.metrics.put_seconds.observe(time.perf_counter() - upload.started)
        if result.evicted:
            log.info("evicted task ids %s to fit task id %d", result.evicted, record.task_id)
        return PutOutcome(record, result.evicted, result.stored)

    def _store_from_disk(self, path: Path, task_id: int, *, name: str, kind: str, replace: bool,
                         source_label: str) -> PutOutcome:
        started = time.perf_counter()
        try:
            sig = disk.signature(path)
            upload = upload_from_disk(path, task_id, name=name, source=source_label, begin=self.begin_upload,
                                      convert=self.convert)
            outcome = self.finish_upload(upload, replace=replace,
                                         source=SourceEntry(task_id, str(path), name, kind, sig))
            if upload.converted_by:
                self.metrics.conversions.labels(upload.converted_by).inc()
        except BaseException:
            self.metrics.adapter_loads.observe(0, time.perf_counter() - started, False)
            raise
        seconds = time.perf_counter() - started
        self.metrics.adapter_loads.observe(outcome.record.num_bytes, seconds, True)
        return outcome

    def _start_workers(self) -> None:
        assert self.convert is not None
        try:
            self.convert.start()
        except Exception as exc:  # noqa: BLE001 - the loads that need them report it again
            log.error("conversion workers did not start: %s", exc)

    def close(self) -> None:
        """Stops the conversion workers, then releases the backend (shm: unlinks its segments)."""
        if self.convert is not None:
            self.convert.close()
        self.backend.close()

    # -- gets ---------------------------------------------------------------
    def get(self, task_id: int, version: str | None = None) -> Reader:
        """The adapter (a use for LRU); reloads from its source on a miss when it has one."""
        reader = self.backend.get(task_id, version)
        if reader is not None:
            return reader
        current = self.backend.has(task_id)
        if version and current and current != version:
            raise NotFoundError(f"task id {task_id} is at version {current}, not {version}")
        source = self.backend.source(task_id) or self._local_sources.get(task_id)
        if source is not None and source.kind in RELOADABLE and current is None:
            self._reload(source, unless="cached")
            reader = self.backend.get(task_id, version)
            if reader is not None:
                return reader
            raise NotFoundError(f"task id {task_id} reloaded from {source.path} at version "
                                f"{self.backend.has(task_id)}, not {version}")
        raise NotFoundError(f"task id {task_id} is not in the host cache (evicted, or never loaded): "
                            "resend its weights and config")

    def _reload(self, source: SourceEntry, *, unless: str = "") -> str:
        """Loads `source` again (-> the version now cached); callers arriving while it loads share that load.

        A caller that saw a miss can reach here just after another caller's load of the same source finished:
        `unless` re-checks inside the flight and keeps what is cached instead of converting it a second time:
        "cached" when the task id is cached at all, "fresh" when it is cached from the files now on disk."""
        def load() -> str:
            version = self._cached_version(source, unless) if unless else None
            return version if version is not None else self._load_source(source).record.version
        return self._loads.run((source.task_id, source.path), load)

    def _cached_version(self, source: SourceEntry, unless: str) -> str | None:
        cached = self.backend.has(source.task_id)
        if cached is None or unless == "cached":
            return cached
        known = self.backend.source(source.task_id)
        if known is None or known.path != source.path or not known.signature:
            return None
        return cached if disk.signature(Path(source.path)) == known.signature else None

    def _load_source(self, source: SourceEntry) -> PutOutcome:
        path = Path(source.path)
        if source.kind in ("root", "path"):
            if self.lora_root is None:
                raise FailedPreconditionError(f"{path} needs --lora-root to be reloaded")
            path = disk.check_inside_root(path, self.lora_root)
        label = f"prefetch:{self.prefetch_dir}" if source.kind == "prefetch" else str(path)
        return self._store_from_disk(path, source.task_id, name=source.name, kind=source.kind,
                                     replace=True, source_label=label)

    def has(self, task_id: int) -> str | None:
        return self.backend.has(task_id)

    # -- names and paths ----------------------------------------------------
    def resolve_name(self, name: str, load_mode: str = "auto") -> tuple[int, str]:
        """name -> (task id, version now cached); load_mode 'auto' | 'always' | 'never'."""
        disk.check_name(name)
        task_id = self.backend.task_for_name(name)
        source = self.backend.source(task_id) if task_id is not None else None
        if (source is None or source.kind == "root") and self.lora_root is not None:
            # Look on disk every time: the adapter may have been added, removed or
            # rewritten (even in another format) since it was last loaded.
            try:
                path = disk.find_named(self.lora_root, name)
            except NotFoundError:
                if source is not None:
                    raise NotFoundError(f"adapter {name!r} is no longer under the adapter root "
                                        f"{self.lora_root}") from None
                path = None
            if path is not None:
                known = source.signature if source is not None and source.path == str(path) else ""
                source = SourceEntry(disk.task_id_for_name(name), str(path), name, "root", known)
        if source is None:
            where = f"under the adapter root {self.lora_root}" if self.lora_root else "(no --lora-root is set)"
            raise NotFoundError(f"no adapter named {name!r}: none was loaded under that name and none is {where}")
        cached = self.backend.has(source.task_id)
        if load_mode == "never" or source.kind not in RELOADABLE:
            if cached is None:
                hint = "resend its weights" if source.kind not in RELOADABLE else "load it first (load mode never)"
                raise NotFoundError(f"adapter {name!r} (task id {source.task_id}) is not cached: {hint}")
            return source.task_id, cached
        if not Path(source.path).exists():
            raise NotFoundError(f"adapter {name!r}: {source.path} no longer exists")
        if load_mode == "auto" and cached is not None and source.signature:
            if disk.signature(Path(source.path)) == source.signature:
                return source.task_id, cached
        return source.task_id, self._reload(source, unless="fresh" if load_mode == "auto" else "")

    def load_path(self, path: str, task_id: int | None, name: str, replace: bool) -> PutOutcome:
        """Loads an adapter from a path under the adapter root and registers it."""
        if self.lora_root is None:
            raise FailedPreconditionError("LoadPath needs the service to run with --lora-root")
        resolved = disk.resolve_load_path(self.lora_root, path)
        name = name or disk.default_name_for(resolved)
        disk.check_name(name)
        tid = task_id if task_id is not None else disk.task_id_for_name(name)
        # Concurrent loads of the same folder as the same adapter share one conversion (as reloads do).
        return self._loads.run(("path", tid, str(resolved), name, replace),
                               lambda: self._store_from_disk(resolved, tid, name=name, kind="path", replace=replace,
                                                             source_label=str(resolved)))

    def evict(self, task_id: int | None, name: str = "", forget_name: bool = False) -> bool:
        if task_id is None:
            if not name:
                raise InvalidArgumentError("evict needs a task id or a name")
            disk.check_name(name)
            task_id = self.backend.task_for_name(name)
            if task_id is None and self.lora_root is not None:
                task_id = disk.task_id_for_name(name)
            if task_id is None:
                raise NotFoundError(f"no adapter named {name!r}")
        evicted = self.backend.evict(task_id)
        if forget_name:
            self.backend.forget_source(task_id)
            self._local_sources.pop(task_id, None)
        return evicted

    # -- listing and start-up -----------------------------------------------
    def listing(self) -> tuple[list[ListedAdapter], list[SourceEntry], CacheStats]:
        """Cached adapters (most recent first), named or reloadable ones not cached, stats."""
        cached = self.backend.listing()
        cached_ids = {a.record.task_id for a in cached}
        known = {s.task_id: s for s in [*self._local_sources.values(), *self.backend.sources()]}
        named = [s for s in known.values() if s.task_id not in cached_ids and (s.name or s.kind in RELOADABLE)]
        return cached, sorted(named, key=lambda s: (s.name, s.task_id)), self.backend.stats()

    def start(self) -> None:
        """Indexes the adapter root and loads the prefetch folder (errors are logged, not fatal); the
        conversion workers start meanwhile, on a thread of their own (a load before they are ready waits
        for them)."""
        if self.convert is not None:
            threading.Thread(target=self._start_workers, name="convert-workers-start", daemon=True).start()
        self.backend.expect_put_bytes(typical_adapter_bytes(self.spec, min(EXPECTED_RANK, self.max_lora_rank)))
        for folder, flag in ((self.lora_root, "--lora-root"), (self.prefetch_dir, "--lora-prefetch-dir")):
            if folder is not None and not folder.is_dir():
                raise FailedPreconditionError(f"{flag} {folder} is not a folder")
        if self.lora_root is not None:
            for name, path in list_adapter_root(self.lora_root).items():
                try:
                    disk.check_name(name)
                    disk.check_inside_root(path, self.lora_root)
                except InvalidArgumentError as exc:
                    log.warning("adapter root: skipping %s: %s", path, exc)
                    continue
                tid = disk.task_id_for_name(name)
                self._local_sources[tid] = SourceEntry(tid, str(path.resolve()), name, "root")
        if self.prefetch_dir is not None:
            for tid, path in list_prefetch_dir(self.prefetch_dir).items():
                source = SourceEntry(tid, str(path.resolve()), "", "prefetch")
                self._local_sources[tid] = source
                try:
                    self._reload(source)
                except Exception as exc:  # noqa: BLE001 - one bad folder must not stop the rest
                    log.error("prefetch %s (task id %d) not loaded: %s", path, tid, exc)
        log.info("host cache ready: %d adapters on disk known", len(self._local_sources))
