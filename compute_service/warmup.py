"""Start-up warm-up: every kernel compiled and every decode graph captured before health says SERVING.

Three passes, then a clean-up:
1. compile: one forward per launch class of `warmup_plan` (decode buckets and
   prefill/mixed token counts, with synthetic adapters and without), run on a
   pool of threads. Triton compiles off the GIL (its passes and ptxas), so the
   classes compile side by side; each forward has its own LoRA batch metadata
   and writes K/V only into blocks no sequence owns yet.
2. graphs: every decode bucket captured (base and LoRA), now a matter of
   replaying compiled kernels.
3. engine: a few real requests through `LLMEngine.add_request/step` (prefill,
   mixed and decode steps, greedy and sampled, with and without adapters), so
   what the first user request runs has run once.
Clean-up: the synthetic adapters leave the pool, the KV cache is zeroed, and the
counters a user reads (evictions, graph steps) are as they were.

Tensor parallel (rank 0 drives followers): every forward holds all-reduces that the
other ranks must join, so the compile pass runs on rank 0 alone with them skipped
(`parallel.alone.peers_skipped`; every rank's shard has the same shapes, so the followers
find its programs in the kernel cache), and the graphs are captured on all ranks at once
(`DriverRunner.capture_graphs`).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from compute_service.build import Runtime, zero_kv_cache
from compute_service.engine.attention import DecodeMetadata, step_metadata
from compute_service.engine.graph_capture import graph_forward
from compute_service.engine.sampler import sample_tokens
from compute_service.engine.sampling_params import SamplingParams
from compute_service.parallel.alone import peers_skipped
from compute_service.warmup_adapters import load_synthetic, unload_synthetic
from compute_service.compile_pool import CompilePool, PoolReport, default_processes, pool_applies, recording
from compute_service.warmup_plan import (GroupShape, LaunchClass, WarmupPlan, describe_quantized, group_shapes, joined,
                                         lora_class_fn, quant_class_fn)
from compute_service.warmup_plan_cache import (PlanCache, PlanKey, PlanLookup, cached_plan, local_parts,
                                               plan_cache_applies, plan_cache_dir)

log = logging.getLogger(__name__)
MODES = ("auto", "full", "light", "off")


@dataclass
class WarmupReport:
    """What the warm-up did and how long each pass took (seconds)."""

    mode: str
    plan: WarmupPlan | None = None
    adapter_ranks: list[int] = field(default_factory=list)
    compile_s: float = 0.0
    graphs_s: float = 0.0
    engine_s: float = 0.0
    total_s: float = 0.0
    num_graphs: int = 0
    compiled_kernels: int | None = None
    pool: PoolReport | None = None          # the compile processes' work, at a cold start


def resolve_mode(mode: str, device: torch.device) -> str:
    """auto: the full plan on CUDA (kernels compile there); on CPU only the engine pass (nothing compiles)."""
    if mode not in MODES:
        raise ValueError(f"warm-up mode must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "full" if device.type == "cuda" else "light"
    return mode


def compiled_kernels() -> int | None:
    """Compiled Triton programs held by the kernels package (None when Triton runs interpreted)."""
    by_kernel = compiled_by_kernel()
    return None if by_kernel is None else sum(by_kernel.values())


def compiled_by_kernel() -> Counter[str] | None:
    """`compiled_kernels` by kernel name."""
    held: Counter[str] = Counter()
    seen = False
    for fn in kernel_functions():
        seen = True
        held[fn.fn.__qualname__] += sum(len(entry[0]) for entry in fn.device_caches.values())
    return held if seen else None


def kernel_functions() -> Iterator[Any]:
    """The kernels package's JIT functions (compiled Triton: none while interpreted), each once, also where one
    module imports another's by name (quant_matmul's launchers)."""
    import sys

    from triton.runtime.jit import JITFunction

    seen: set[int] = set()
    for name, mod in list(sys.modules.items()):
        if not (name == "kernels" or name.startswith("kernels.")) or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, JITFunction) and getattr(obj, "device_caches", None) is not None \
                    and id(obj) not in seen:
                seen.add(id(obj))
                yield obj


def describe_compiled(count: int | None) -> str:
    """`compiled_kernels()` for a log line."""
    return "no compiled Triton programs (kernels interpreted or unused)" if count is None \
        else f"{count} Triton programs"


def warm_up(rt: Runtime, mode: str = "auto", num_threads: int = 0, compile_processes: int = 0) -> WarmupReport:
    """Runs the passes `mode` asks for; call before the runner starts and before health says SERVING.
    `compile_processes`: workers compiling at a cold start (0 = `default_processes()`, -1 = none)."""
    mode = resolve_mode(mode, rt.device)
    report = WarmupReport(mode)
    t_start = time.perf_counter()
    if mode == "off":
        _capture(rt, report)
        return report
    engine = rt.engine
    keys = load_synthetic(rt.slots)
    report.adapter_ranks = [rank for _, rank in keys]
    tensor_parallel = hasattr(engine.runner, "capture_graphs")
    try:
        if mode == "full":
            if tensor_parallel:
                log.info("warm-up: tensor parallel: the compile pass runs on rank 0 alone, its all-reduces skipped "
                         "(every rank's shard has the same shapes; the other ranks read its kernels from the cache)")
            with peers_skipped(engine.runner.model) if tensor_parallel else nullcontext():
                _compile_pass(rt, [k for k, _ in keys], report, num_threads, compile_processes)
        _capture(rt, report)
        t = time.perf_counter()
        _engine_pass(rt, [k for k, _ in keys], long_prompt=mode == "full")
        report.engine_s = time.perf_counter() - t
        log.info("warm-up: real requests through the engine in %.1f s", report.engine_s)
    finally:
        unload_synthetic(rt.slots, keys)
        zero_kv_cache(engine)
        engine.runner.num_graph_steps = engine.runner.num_lora_graph_steps = 0
        engine.runner.num_prefill_graph_steps = 0
    stats, pool = engine.stats(), rt.slots.stats()
    if stats.num_kv_blocks_used or stats.num_running or stats.num_waiting or pool.pages_used:
        raise RuntimeError(f"warm-up left state behind: {stats.num_kv_blocks_used} KV blocks, "
                           f"{pool.pages_used} adapter pages, {stats.num_running + stats.num_waiting} sequences")
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)
    report.compiled_kernels = compiled_kernels()
    report.total_s = time.perf_counter() - t_start
    return report


def _capture(rt: Runtime, report: WarmupReport) -> None:
    runner = rt.engine.runner
    graphs = runner.graphs
    if graphs is None:
        return
    t = time.perf_counter()
    if hasattr(runner, "capture_graphs"):
        runner.capture_graphs()                # tensor parallel: every rank captures the same graphs at once
    else:
        graphs.capture_all(runner.lora)
    report.graphs_s = time.perf_counter() - t
    report.num_graphs = 2 * len(graphs.buckets)
    log.info("warm-up: captured %d decode CUDA graphs and %d prefill CUDA graphs in %.1f s", report.num_graphs,
             graphs.prefill.num_captured, report.graphs_s)


def _spare_backend(rt: Runtime) -> Any:
    """A LoRA backend like the engine's over the same pool, with its own batch metadata and buffers (the pool the
    engine's backend reads: under tensor parallelism the rank's share, where `rt.slots` takes whole adapters)."""
    engine_lora = rt.engine.runner.lora
    backend = type(engine_lora)(engine_lora.slots, rt.engine.config.max_num_batched_tokens)
    if hasattr(backend, "allocate"):
        backend.allocate()
    return backend


def _compile_pass(rt: Runtime, keys: list[str], report: WarmupReport, num_threads: int,
                  compile_processes: int) -> None:
    engine, slots = rt.engine, rt.slots
    graphs = engine.runner.graphs
    slot_ids = [slots.slot_of(k) for k in keys]
    _touch_triton_driver(rt.device)
    width = graphs.meta.block_tables.shape[1] if graphs is not None else 1
    pass_ = _ForwardPass(rt, slot_ids, width)
    # A cold start (no saved plan: Triton's cache, beside it, is cold too) compiles in worker processes: the
    # decode forwards, then the plan's dry runs, then one recording pass over the other steps hand every
    # program to them as it is recorded. A saved plan means a warm cache, where the steps below only read it.
    pool = CompilePool(compile_processes or default_processes()) \
        if compile_processes >= 0 and pool_applies(rt.device.type) else None
    decodes = [(pass_.decode, b, lora) for b in (graphs.buckets if graphs is not None else [])
               for lora in (False, True)]          # the plan's decode buckets
    recorded: list[tuple[Callable[..., None], Any, bool]] = []

    def on_plan_miss() -> None:
        if pool is not None:
            pool.start()
            if _record(decodes):             # the base programs compile while the dry runs go on
                recorded.extend(decodes)

    try:
        with recording(pool):
            lookup = _plan(rt, slot_ids, report.adapter_ranks, on_plan_miss)
        plan = report.plan = lookup.plan
        # Phase 1: every LoRA group alone at every class's token count, at layers 0, 1 and 2 (Triton may
        # specialise the layer index on being 1 or a multiple of 16: 0 and 16 share a program, 2..15
        # another), beside one base decode and the base prefills: short chains of compiles, so the threads
        # share the work evenly. Phase 2: whole forwards with adapters, and the other decode buckets, which
        # then find their programs compiled (or compile what phase 1 did not foresee).
        lora_tokens = plan.decode_buckets + plan.prefill_tokens
        layers = [i for i in (0, 1, 2) if i < engine.spec.num_layers]
        first = [(pass_.decode, b, False) for b in plan.decode_buckets[:1]]
        first += [(pass_.prefill, n, False) for n in plan.base_prefill_tokens]
        first += [(pass_.sample, 1, False)]         # a batch with a sampled row (greedy alone is the library's)
        first += [(pass_.lora_group, (n, g, layer), True) for n in lora_tokens for g in group_shapes(engine.spec)
                  for layer in layers]
        second = [(pass_.decode, b, lora) for b in plan.decode_buckets for lora in (False, True)][1:]
        second += [(pass_.prefill, n, True) for n in plan.prefill_tokens]
        threads = num_threads or min(16, os.cpu_count() or 1)
        log.info("warm-up: %s: %d decode buckets, %d prefill/mixed token counts %s, "
                 "%d base prefill; %d + %d steps on %d threads, adapters of rank %s", lookup.describe(),
                 len(plan.decode_buckets), len(plan.prefill_tokens), plan.prefill_tokens,
                 len(plan.base_prefill_tokens), len(first), len(second), threads, report.adapter_ranks)
        t = time.perf_counter()
        if pool is not None and pool.started:
            _compile_in_processes(pool, [task for task in first + second if task not in recorded], report)
    finally:
        if pool is not None:
            pool.close()
    with _launchers_one_at_a_time(), ThreadPoolExecutor(threads, thread_name_prefix="warmup") as workers:
        for phase, tasks in enumerate((first, second), start=1):
            for fut in [workers.submit(fn, n, lora) for fn, n, lora in tasks]:
                fut.result()
            log.info("warm-up: phase %d/2 (%d steps) done at %.1f s, %s", phase, len(tasks),
                     time.perf_counter() - t, describe_compiled(compiled_kernels()))
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)
    report.compile_s = time.perf_counter() - t
    log.info("warm-up: kernels compiled in %.1f s (%s)", report.compile_s, describe_compiled(compiled_kernels()))


def _record(tasks: list[tuple[Callable[..., None], Any, bool]]) -> bool:
    """Runs `tasks` under the compile pool's recording hook (their launches skipped); False, and a warning,
    if one fails (the threads compile whatever was not handed over)."""
    try:
        for fn, n, lora in tasks:
            fn(n, lora)
        return True
    except Exception as exc:  # noqa: BLE001 - a recording is only a head start
        log.warning("warm-up: a recording pass stopped (%s: %s); the threads compile the rest",
                    type(exc).__name__, exc)
        return False


def _compile_in_processes(pool: CompilePool, tasks: list[tuple[Callable[..., None], Any, bool]],
                          report: WarmupReport) -> None:
    """The remaining steps' programs handed to the pool's workers (launches skipped), then waits for them."""
    t = time.perf_counter()
    with recording(pool):
        _record(tasks)
    recorded_s = time.perf_counter() - t
    report.pool = pool.wait()
    log.info("warm-up: %s; recording took %.1f s, the last programs %.1f s more", report.pool.describe(),
             recorded_s, report.pool.wait_s)
    log.info("warm-up: compile time by kernel: %s", report.pool.costliest())


def _plan(rt: Runtime, slot_ids: list[int], adapter_ranks: list[int],
          on_miss: Callable[[], None] | None = None) -> PlanLookup:
    """The compile pass's plan: read from the on-disk cache where it applies, else dry runs of a spare backend
    (after `on_miss()`, which starts the compile pool: the dry runs' programs go to it as they are recorded)."""
    engine = rt.engine
    graphs = engine.runner.graphs
    mnbt = engine.config.max_num_batched_tokens
    dtype = engine.runner.model.dtype
    decode_buckets = graphs.buckets if graphs is not None else []
    launched = engine.runner.launched_tokens
    cache = _plan_cache(rt, slot_ids, adapter_ranks, decode_buckets, launched)
    def classify() -> Callable[[int], LaunchClass]:
        if on_miss is not None:
            on_miss()
        return joined(lora_class_fn(_spare_backend(rt), engine.spec, mnbt, slot_ids, dtype, rt.device),
                      quant_class_fn(engine.runner.model, dtype, rt.device))

    return cached_plan(mnbt, decode_buckets, launched, classify, cache)


def _plan_cache(rt: Runtime, slot_ids: list[int], adapter_ranks: list[int], decode_buckets: list[int],
                launched: Callable[[int], int]) -> PlanCache | None:
    """Where this start's plan is kept, under a key of everything it depends on; None where no plan is kept
    (not CUDA, no launch keys, turned off) or the key cannot be built (a warning: the plan is computed)."""
    if not plan_cache_applies(rt.device):
        return None
    engine, tables, layout = rt.engine, rt.slots.tables, rt.slots.layout
    if tables is None or layout is None:
        raise RuntimeError("the adapter pool is not allocated yet: the warm-up plan needs its geometry")
    mnbt = engine.config.max_num_batched_tokens
    try:
        local = local_parts(rt.device)
    except OSError as exc:
        log.warning("warm-up: no plan cache, the sources could not be read for its key (%s)", exc)
        return None
    key = PlanKey(**local, spec=repr(engine.spec), max_num_batched_tokens=mnbt,
                  decode_buckets=tuple(decode_buckets), launched_tokens=tuple(map(launched, range(1, mnbt + 1))),
                  adapters=tuple(zip(slot_ids, adapter_ranks)), dtype=str(engine.runner.model.dtype),
                  backend=f"{type(engine.runner.lora).__module__}.{type(engine.runner.lora).__qualname__}",
                  quantized=describe_quantized(engine.runner.model),
                  pool=(tables.max_slots, tables.num_layers, tables.num_modules, tables.max_rank, tables.row_align,
                        layout.page_elems))
    return PlanCache(plan_cache_dir(), key.digest())


@contextmanager
def _launchers_one_at_a_time() -> Iterator[None]:
    """Serialises Triton's per-program handle set-up (module load, launcher) while the pool runs.

    The first run of a compiled program builds and imports its launcher, a small C module that always has
    the same module name; two threads importing two of them at once can each get the other's (seen on an
    H200 with a warm Triton cache: a launch failing with the wrong number of arguments). Compiling, the
    slow part, stays parallel; only that set-up takes turns.
    """
    try:
        from triton.compiler.compiler import CompiledKernel
    except ImportError:
        yield
        return
    original = CompiledKernel.__dict__.get("_init_handles")
    if original is None:
        yield
        return
    lock = threading.RLock()

    def init_handles(self: Any) -> Any:
        with lock:
            return original(self)

    CompiledKernel._init_handles = init_handles
    try:
        yield
    finally:
        CompiledKernel._init_handles = original


def _touch_triton_driver(device: torch.device) -> None:
    """Triton's driver initialises lazily on first use, and so does the hash of Triton's own sources and
    library that every cache key includes: both once here, not raced by the pool's threads (16 threads each
    hashing Triton's library at once took ~0.6 s of thread time each, measured in a warm start)."""
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        import importlib

        from triton.runtime import driver

        driver.active.get_current_device()
        for name in ("triton.runtime.cache", "triton.compiler.compiler"):
            key_fn = getattr(importlib.import_module(name), "triton_key", None)
            if key_fn is not None:       # memoised: later calls return the hash at once
                key_fn()
                break


class _ForwardPass:
    """Model forwards outside the engine, for compiling: each with its own LoRA metadata, all writing K/V into
    the first blocks of the cache (no sequence owns any block yet; the cache is zeroed afterwards)."""

    def __init__(self, rt: Runtime, slot_ids: list[int], table_width: int) -> None:
        self.rt = rt
        self.model = rt.engine.runner.model
        self.kv = rt.engine.runner.kv_caches
        self.block_size = rt.engine.runner.block_size
        self.slot_ids = slot_ids or [-1]
        self.table_width = table_width
        self.max_len = rt.engine.max_model_len

    def _lora(self, num_tokens: int, with_lora: bool) -> Any:
        if not with_lora:
            return None
        backend = _spare_backend(self.rt)
        # Adapters alternate over the tokens, one in four without: several segments, as in a mixed batch.
        ids = [-1 if i % 4 == 3 else self.slot_ids[i % len(self.slot_ids)] for i in range(num_tokens)]
        backend.prepare(torch.tensor(ids, dtype=torch.int32))
        return backend

    def lora_group(self, what: tuple[int, GroupShape, int], with_lora: bool) -> None:
        """One LoRA group's launches for `num_tokens` tokens at `layer`, outside a forward."""
        num_tokens, group, layer = what
        dev, dtype = self.model.device, self.model.dtype
        x = torch.randn(num_tokens, group.k, dtype=dtype, device=dev)
        y = torch.zeros(num_tokens, sum(group.widths), dtype=dtype, device=dev)
        self._lora(num_tokens, with_lora).apply(layer, group.name, x, list(y.split(list(group.widths), dim=-1)))

    def decode(self, batch: int, with_lora: bool) -> None:
        dev = self.model.device
        meta = DecodeMetadata(torch.arange(batch, dtype=torch.int64, device=dev),
                              torch.zeros(batch, self.table_width, dtype=torch.int32, device=dev),
                              torch.ones(batch, dtype=torch.int32, device=dev))
        ids = torch.zeros(batch, dtype=torch.int64, device=dev)
        with graph_forward():            # as the decode graphs run it: what they launch compiles here
            hidden = self.model.forward(ids, ids.clone(), meta, self.kv, self._lora(batch, with_lora))
        self.model.compute_logits(hidden)

    def prefill(self, num_tokens: int, with_lora: bool) -> None:
        dev = self.model.device
        per_seq = min(num_tokens, self.max_len - 1)
        lens = [per_seq] * (num_tokens // per_seq) + ([num_tokens % per_seq] if num_tokens % per_seq else [])
        table = list(range(-(-per_seq // self.block_size)))
        meta = step_metadata(lens, lens, [table] * len(lens), self.block_size, dev)
        ids = torch.randint(0, self.model.spec.vocab_size, (num_tokens,), device=dev)
        positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
        hidden = self.model.forward(ids, positions, meta, self.kv, self._lora(num_tokens, with_lora))
        self.model.compute_logits(hidden[-1:])

    def sample(self, batch: int, with_lora: bool) -> None:
        """The sampler's launches (`kernels.sample` on a GPU) for `batch` sampled rows: plain, top-p alone (the race
        checked against the nucleus, `kernels.sample_nucleus`), and top-k alone and with top-p
        (`kernels.sample_threshold`'s two candidate counts); a batch of greedy rows alone launches the library's
        argmax only. `with_lora`: unused, the compile tasks' shape."""
        vocab = self.model.weights.lm_head.shape[0]
        logits = torch.zeros(batch, vocab, dtype=torch.float32, device=self.model.device)
        for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_p=0.9),
                       SamplingParams(temperature=0.8, top_k=50), SamplingParams(temperature=0.8, top_k=50, top_p=0.9)):
            sample_tokens(logits, [params] * batch, [0] * batch, [0] * batch)


def _engine_pass(rt: Runtime, keys: list[str], long_prompt: bool) -> None:
    """Real requests: a long prompt with an adapter, a short one without (sampled), another adapter's; run
    together, so the steps are prefill, mixed (a chunk beside decodes) and decode, with graphs where on.
    The long prompt is a step's worth of tokens and more (chunked) with `long_prompt`, else short."""
    engine = rt.engine
    vocab = engine.spec.vocab_size
    stats = engine.stats()
    room = stats.num_kv_blocks_total * engine.config.block_size // 2 - 64    # all three fit in the KV cache
    longest = engine.config.max_num_batched_tokens + 8 if long_prompt else 24
    max_prompt = max(2, min(engine.max_model_len - 8, longest, room))
    lengths = [max_prompt, min(9, max_prompt), min(40, max_prompt)]
    adapters: list[str | None] = [keys[0] if keys else None, None, keys[-1] if keys else None]
    params = [SamplingParams(max_tokens=4, temperature=0.0, seed=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.8, top_k=20, top_p=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.0, seed=2, ignore_eos=True)]
    gen = torch.Generator().manual_seed(0)
    for i, (n, key, p) in enumerate(zip(lengths, adapters, params)):
        prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
        engine.add_request(f"__warmup__{i}", prompt, p, key)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps > 10_000:
            raise RuntimeError("warm-up requests did not finish")
