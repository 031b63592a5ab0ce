"""Triton programs compiled in worker processes, so a cold start compiles on every core.

The warm-up's threads compile side by side only where Triton drops the GIL; its
front end (kernel source to IR) and each program's launcher build hold it or run
one at a time. Measured on an H200 host (16 cores, cold Triton cache): 159
compiles, 158 s summed over the threads, 18.4 s of wall time on 16 threads.

So, at a cold start:
1. `CompilePool.start` spawns the workers at once when the warm-up finds no
   saved plan (their imports then overlap its work; spawned before the model
   loaded instead, they slowed the main process as much as they saved).
2. Under `recording(pool)` (a Triton JIT cache hook) a kernel launch is neither
   compiled nor run: its specialisation (Triton's own serialised form) goes to
   the pool, once per distinct program. The warm-up's decode forwards, its
   plan's dry runs and one pass over its other steps run this way.
3. Each worker compiles its programs into Triton's on-disk cache under the key the
   main process computes for the same program, and builds the program's launcher
   into the same cache.
4. `wait` returns when every program is done; the warm-up then runs its steps for
   real, and every compile is a cache read.

Nothing here decides what a step runs: a program a worker could not compile (or a
worker that died) is compiled by the main process when the step launches it, as
before. Workers are spawned (the service runs threads) and never touch the GPU:
they compile for the main process's target, passed to them. As with any spawned
worker, a script that calls `warm_up` itself must keep its top-level code under
`if __name__ == "__main__":` (each worker imports the main module), or pass
`compile_processes=-1`.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import pkgutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from loraplex.host_limits import available_memory, usable_cpus
from loraplex.worker_pool import spawned_pool, start_workers

log = logging.getLogger(__name__)
MAX_PROCESSES = 16
KERNEL_PACKAGES = ("kernels",)
WORKER_BYTES = 1 << 30                           # host memory a worker may take (Python, torch, Triton, compiles)
WAIT_S = 600.0                                   # the longest the warm-up waits for the workers (a hung compile)


def default_processes() -> int:
    """One per usable CPU but one (the main process records meanwhile), up to MAX_PROCESSES and to one per
    GiB of the memory available now (both within the container's cgroup limits: `loraplex.host_limits`)."""
    memory = available_memory()
    by_memory = MAX_PROCESSES if memory is None else memory // WORKER_BYTES
    return max(1, min(MAX_PROCESSES, usable_cpus() - 1, by_memory))


def pool_applies(device_type: str) -> bool:
    """Worker compiles need a GPU target and Triton's JIT cache hook; not under the interpreter."""
    if device_type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton import knobs
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        return False
    return hasattr(knobs.runtime, "jit_cache_hook")


# ---- in the workers ------------------------------------------------------------------------------------


def _import_kernels() -> None:
    """A worker's setup: the imports a compile needs, done before the first one."""
    for name in KERNEL_PACKAGES:
        pkg = importlib.import_module(name)
        for info in pkgutil.iter_modules(pkg.__path__, name + "."):
            importlib.import_module(info.name)


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def source_class(fn: Any) -> type:
    """The Triton source type `fn` compiles from: the explicit-layout dialect's kernels (`is_gluon`) parse
    only as their own (as plain Triton source their layout builtins fail to parse)."""
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource
    from triton.compiler import ASTSource

    return ASTSource


def compile_program(module: str, qualname: str, spec: str, target: tuple[str, int, int]) -> float:
    """In a worker: compiles one program from Triton's serialised specialisation into the on-disk cache and
    builds its launcher there too; returns the seconds it took."""
    t0 = time.perf_counter()
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    data = json.loads(spec)
    fn: Any = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    while not isinstance(fn, JITFunction):           # a decorator around the JIT function
        if not hasattr(fn, "fn"):
            raise TypeError(f"{module}.{qualname} is not a Triton JIT function here")
        fn = fn.fn
    constants = {tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
                 tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
                 for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    signature = {k: _as_tuple(v) for k, v in data["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    kernel = triton.compile(source_class(fn)(fn, signature, constants, attrs), target=GPUTarget(*target),
                            options=options)
    try:                                             # the launcher, a small C module, cached by its source
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - only a cache warm-up: the main process builds it when it launches
        pass
    return time.perf_counter() - t0


# ---- in the service ------------------------------------------------------------------------------------


@dataclass
class PoolReport:
    """What the pool did: programs handed to it, compiled, failed (compiled later by the main process)."""

    processes: int = 0
    programs: int = 0
    compiled: int = 0
    failed: int = 0
    worker_s: float = 0.0                           # seconds summed over the workers
    wait_s: float = 0.0                              # seconds the warm-up waited for the last programs
    errors: list[str] = field(default_factory=list)
    kernel_s: dict[str, list[float]] = field(default_factory=dict)   # kernel -> seconds of each of its programs

    def describe(self) -> str:
        text = (f"{self.compiled}/{self.programs} Triton programs compiled in {self.processes} processes "
                f"({self.worker_s:.1f} s summed)")
        return text + (f"; {self.failed} left to the warm-up ({self.errors[0]})" if self.failed else "")

    def costliest(self, n: int = 3) -> str:
        """The n kernels whose programs took the most compile time, e.g. "quant_mma_kernel: 14 programs,
        41.0 s (the longest 6.2 s)": what a cold start's last programs wait for."""
        top = sorted(self.kernel_s.items(), key=lambda kv: -sum(kv[1]))[:n]
        return ", ".join(f"{name}: {len(ts)} programs, {sum(ts):.1f} s (the longest {max(ts):.1f} s)"
                         for name, ts in top) or "none"


class CompilePool:
    """Spawned compile workers and the programs handed to them (each distinct one once)."""

    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError("processes must be >= 1")
        self.processes = processes
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._seen: set[tuple[str, str, str]] = set()
        self._futures: list[tuple[str, Future[float]]] = []
        self._target: tuple[str, int, int] | None = None
        self.report = PoolReport(processes=processes)

    @property
    def started(self) -> bool:
        return self._pool is not None

    def start(self) -> None:
        """Spawns the workers without waiting for them: they import while the caller goes on."""
        with self._lock:
            self._spawn()

    def _spawn(self) -> ProcessPoolExecutor:
        """The executor, made (and every worker spawned) on first use; the caller holds the lock."""
        if self._pool is None:
            self._pool = spawned_pool(self.processes, _import_kernels)
            start_workers(self._pool, self.processes)
        return self._pool

    def set_target(self, target: tuple[str, int, int]) -> None:
        """The GPU target the main process compiles for (backend, architecture, warp size)."""
        self._target = target

    def submit(self, module: str, qualname: str, spec: str) -> bool:
        """Hands one program to a worker; False if it was handed over before (or the pool is gone)."""
        if self._target is None:
            raise RuntimeError("the compile pool has no target: call set_target first")
        key = (module, qualname, spec)
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            self.report.programs += 1
            pool = self._spawn()
            try:
                future = pool.submit(compile_program, module, qualname, spec, self._target)
            except (BrokenProcessPool, RuntimeError) as exc:
                self._failed(qualname, exc)
                return True
            self._futures.append((qualname, future))
        return True

    def _failed(self, qualname: str, exc: BaseException) -> None:
        self.report.failed += 1
        if len(self.report.errors) < 5:
            self.report.errors.append(f"{qualname}: {type(exc).__name__}: {str(exc)[:200]}")

    def wait(self, timeout_s: float = WAIT_S) -> PoolReport:
        """Waits for every program handed over so far, `timeout_s` at most in all; failures (and programs
        not done in time) are counted, never raised: the main process compiles them when it launches them."""
        t0 = time.perf_counter()
        with self._lock:
            futures, self._futures = self._futures, []
        for qualname, future in futures:
            try:
                left = max(0.0, timeout_s - (time.perf_counter() - t0))
                seconds = future.result(timeout=left)
                self.report.worker_s += seconds
                self.report.compiled += 1
                self.report.kernel_s.setdefault(qualname, []).append(seconds)
            except FutureTimeout:
                future.cancel()
                self._failed(qualname, TimeoutError(f"not compiled within {timeout_s:.0f} s of the wait"))
            except Exception as exc:  # noqa: BLE001 - the main process compiles it when a step launches it
                self._failed(qualname, exc)
        self.report.wait_s += time.perf_counter() - t0
        return self.report

    def close(self) -> None:
        """Stops the workers (their memory goes back before the service serves)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            workers = list(getattr(pool, "_processes", {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in workers:                     # one still compiling (a wait that timed out) stops now
                if proc.is_alive():
                    proc.terminate()

    def hook(self, *args: Any, **kwargs: Any) -> bool:
        """Triton's JIT cache hook: hands the program to the pool and tells Triton to skip it."""
        fn, compile_args = kwargs.get("fn"), kwargs.get("compile") or {}
        spec = compile_args.get("specialization_data")
        if fn is not None and spec is not None and "<locals>" not in fn.name:
            self.submit(getattr(fn.module, "__name__", fn.module), fn.name, spec)
        return True


@contextmanager
def recording(pool: CompilePool | None) -> Iterator[None]:
    """Triton launches inside are handed to `pool` and skipped (nothing compiled or run in this process);
    with no pool, a no-op. Sets the pool's target from this process's Triton driver."""
    if pool is None:
        yield
        return
    from triton import knobs
    from triton.runtime import driver

    target = driver.active.get_current_target()
    pool.set_target((target.backend, target.arch, target.warp_size))
    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = pool.hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = old
