"""Which steps the start-up warm-up must run so that no request ever compiles a kernel.

The LoRA kernels pick block sizes, K splits and column groups from the step's
token count T (and from shapes fixed at start), and Triton compiles one program
per distinct launch key. Rather than restate the kernels' choices here, the
plan asks Triton: with a JIT cache hook that records each launch's key and
skips compiling and launching (a dry run, no device work from the kernels),
it runs the LoRA backend's `prepare` and every group's `apply` for each T from
1 to `max_num_batched_tokens`, and groups the token counts by the keys they
produce. One step per group then compiles everything a step of any size can
launch. The other kernels (norm, RoPE + KV write, SwiGLU, decode attention) do
not depend on T beyond Triton's divisibility-by-16 specialisation of integer
arguments, which the class includes; a quantized base's projections do (their
kernels pick tiles and K splits from T), so their launch keys join the class,
recorded the same way (`quant_class_fn`). (The norm and SwiGLU also write x's
slice sums where the projection after them takes its pair-codes path: a choice
made from the same T, so it is named by that projection's launch key; the dry runs hand a projection those
sums where the forward does, so that they record no launch of the sums the forward never makes.) Where
nothing compiles (CPU, the Triton interpreter) every T falls in one class. The plan is kept on disk between starts
(`warmup_plan_cache.py`), so a restart of the same code on the same GPU with the
same settings skips the dry runs.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from compute_service.adapter_cache.layout import module_features
from compute_service.engine.lora_backend import GROUP_MODULE_IDS, NO_ADAPTER
from compute_service.engine.spec import ModelSpec

LaunchClass = tuple


class LaunchRecorder:
    """Context manager: Triton launches inside it are recorded (kernel and launch key), never compiled or run.
    A JIT cache hook already set (`compile_pool.recording`) is called for each launch as well, unless `pass_on`
    is False (launches that stand for the forward's without being exactly its: their programs are left to the
    forwards' own recordings)."""

    def __init__(self, pass_on: bool = True) -> None:
        self.keys: list[str] = []
        self._old: Any = None
        self._pass_on = pass_on

    @staticmethod
    def available() -> bool:
        import os

        if os.environ.get("TRITON_INTERPRET") == "1":
            return False
        try:
            from triton import knobs
        except ImportError:
            return False
        return hasattr(knobs.runtime, "jit_cache_hook")

    def _hook(self, *args: Any, **kwargs: Any) -> bool:
        self.keys.append(f"{kwargs.get('repr', '')}|{kwargs.get('key', args[:1])}")
        if self._old is not None and self._pass_on:     # a hook outside (the compile pool's) sees the launch too
            self._old(*args, **kwargs)
        return True      # skip: no compile, no launch

    def __enter__(self) -> "LaunchRecorder":
        from triton import knobs

        self._old = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook
        return self

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._old


@dataclass(frozen=True)
class GroupShape:
    """One LoRA group as the model calls it: input width and the widths of its output slices."""

    name: str
    k: int
    widths: tuple[int, ...]


def group_shapes(spec: ModelSpec) -> list[GroupShape]:
    feats = module_features(spec)
    return [GroupShape(name, feats[ids[0]][0], tuple(feats[m][1] for m in ids))
            for name, ids in GROUP_MODULE_IDS.items()]


def lora_class_fn(backend: Any, spec: ModelSpec, max_tokens: int, slot_ids: list[int], dtype: torch.dtype,
                  device: torch.device) -> Callable[[int], LaunchClass]:
    """T -> the launch keys of one LoRA step of T tokens through `backend` (a spare one: its metadata is
    overwritten). Tokens cycle over `slot_ids`, one in four without adapter, as a mixed batch."""
    if not LaunchRecorder.available() or device.type != "cuda":
        return lambda t: ()
    groups = group_shapes(spec)
    xs = {g.name: torch.zeros(max_tokens, g.k, dtype=dtype, device=device) for g in groups}
    ys = {g.name: torch.zeros(max_tokens, sum(g.widths), dtype=dtype, device=device) for g in groups}
    slots = slot_ids or [NO_ADAPTER]
    layer = min(1, spec.num_layers - 1)     # a layer index Triton does not specialise as a multiple of 16

    def launch_keys(t: int) -> LaunchClass:
        ids = torch.tensor([NO_ADAPTER if i % 4 == 3 else slots[i % len(slots)] for i in range(t)],
                           dtype=torch.int32)
        with LaunchRecorder() as rec:
            backend.prepare(ids)
            for g in groups:
                backend.apply(layer, g.name, xs[g.name][:t], list(ys[g.name][:t].split(list(g.widths), dim=-1)))
        return tuple(rec.keys)
    return launch_keys


def quantized_projections(model: Any) -> list[Any]:
    """One of each distinct quantized base projection on the kernels (`QuantLinear`): shape, bits, group size
    and the row count from which it dequantizes and calls the library GEMM."""
    seen: dict[tuple[int, ...], Any] = {}
    for _, p in _kernel_projections(model):
        seen.setdefault(_launch_parts(p), p)
    return list(seen.values())


def _kernel_projections(model: Any) -> Iterator[tuple[str, Any]]:
    """(name, projection) of every layer's quantized base projection on the kernels (`QuantLinear`)."""
    from compute_service.engine.model import LAYER_PROJECTIONS
    from compute_service.engine.quant_linear import QuantLinear

    for layer in model.weights.layers:
        for name in LAYER_PROJECTIONS:
            p = getattr(layer, name)
            if isinstance(p, QuantLinear) and p.use_kernel:
                yield name, p


def _launch_parts(p: Any) -> tuple[int, ...]:
    """What a quantized projection's launches depend on: shape, bits, group size, the GEMM switch's row count."""
    return p.out_features, p.in_features, p.bits, p.group_size, p.dense_min_tokens


def describe_quantized(model: Any) -> str:
    """The quantized projections' parts a plan depends on (`quantized_projections`); '' for a dense model."""
    return ";".join(f"{p.out_features}x{p.in_features}:{p.bits}b:g{p.group_size}:d{p.dense_min_tokens}"
                    for p in quantized_projections(model))


def quant_class_fn(model: Any, dtype: torch.dtype, device: torch.device) -> Callable[[int], LaunchClass]:
    """T -> the launch keys of the quantized base projections at T rows: their kernels pick tiles and K splits
    from T (`kernels.quant_matmul.pick_config`), so a step of T tokens can need programs no other T compiled;
    at 2+ rows both choices, alone and beside a LoRA launch (`QuantLinear(..., beside_lora=True)`).
    From `dense_min_tokens` rows a projection dequantizes and calls the library GEMM, the same launches at
    every T: one class of its own, without a dry run."""
    projections = _projection_calls(model)
    if not projections or not LaunchRecorder.available() or device.type != "cuda":
        return lambda t: ()
    rows = max(p.dense_min_tokens for p, _, _ in projections)
    xs = {k: torch.zeros(rows, k, dtype=dtype, device=device) for k in {p.in_features for p, _, _ in projections}}

    def launch_keys(t: int) -> LaunchClass:
        keys: list[str] = []
        for p, sums_written, ordered in projections:
            if t >= p.dense_min_tokens:
                keys.append(f"dequantize+GEMM {p.out_features}x{p.in_features}")
                continue
            width = p.sums_width(t, dtype, ordered) if sums_written else 0      # as the forward calls it (`_x_sums`)
            kw: dict[str, Any] = {"ordered": True} if ordered else {}
            if width:
                kw["x_sums"] = torch.zeros(t, p.in_features // width, dtype=torch.float32, device=device)
            # Keys only: the forward calls a projection as here but sums a split launch's partials in the next
            # kernel or in the launch depending on where its LoRA runs (`LlamaModel._project`), so these launches'
            # programs are not all ones a forward runs; the forwards' recordings hand the pool those.
            with LaunchRecorder(pass_on=False) as rec:
                p(xs[p.in_features][:t], **kw)
                if t > 1:       # beside a LoRA launch (graphs of 2+ tokens) pick_config may choose other programs
                    p(xs[p.in_features][:t], beside_lora=True, **kw)
            keys.extend(rec.keys)
        return tuple(keys)
    return launch_keys


def _projection_calls(model: Any) -> list[tuple[Any, bool, bool]]:
    """`quantized_projections`, each with whether the forward hands it x's slice sums written by the kernel
    before it (`LlamaModel.writes_sums`), else it launches their sums itself, and whether that kernel writes x
    in the projection's own channel order (act-order, `LlamaModel.writes_ordered`), else the call gathers x:
    one of each such kind, so the dry runs launch what the forward launches and nothing else (a launch only a
    dry run makes would be compiled at start-up for nothing)."""
    writes = getattr(model, "writes_sums", lambda name: False)
    ordered = getattr(model, "writes_ordered", lambda name, p: False)
    seen: dict[tuple[Any, ...], tuple[Any, bool, bool]] = {}
    for name, p in _kernel_projections(model):
        call = (writes(name), ordered(name, p))
        seen.setdefault((*_launch_parts(p), *call), (p, *call))
    return list(seen.values())


def joined(*class_fns: Callable[[int], LaunchClass]) -> Callable[[int], LaunchClass]:
    """T -> the launch keys of every class function, one after another (a step runs all of them)."""
    return lambda t: tuple(key for fn in class_fns for key in fn(t))


@dataclass
class WarmupPlan:
    """Token counts to run: decode buckets (graphs) and prefill/mixed steps."""

    decode_buckets: list[int]
    prefill_tokens: list[int]           # LoRA steps: one per class no decode bucket covers
    base_prefill_tokens: list[int]      # base-model prefill: one per divisibility class
    num_classes: int

    @property
    def num_steps(self) -> int:
        return 2 * len(self.decode_buckets) + len(self.prefill_tokens) + len(self.base_prefill_tokens)


def make_plan(max_num_batched_tokens: int, decode_buckets: Iterable[int],
              lora_class: Callable[[int], LaunchClass],
              launched_tokens: Callable[[int], int] = lambda t: t) -> WarmupPlan:
    """One representative token count per class over every T a step can have (1..max_num_batched_tokens).

    `launched_tokens(T)`: the token count a prefill/mixed step of T tokens launches its kernels with (its
    prefill graph bucket where a prefill graph runs it, else T), so only counts that can occur are planned."""
    buckets = sorted(set(decode_buckets))
    seen = {(t % 16 == 0, lora_class(t)) for t in buckets}
    prefill, base, base_seen = [], [], set()
    for t in sorted({launched_tokens(t) for t in range(1, max_num_batched_tokens + 1)}):
        c = (t % 16 == 0, lora_class(t))
        if c not in seen:
            seen.add(c)
            prefill.append(t)
        if c[0] not in base_seen:      # prefill runs other attention code than decode: its own base steps
            base_seen.add(c[0])
            base.append(t)
    return WarmupPlan(buckets, prefill, base, len(seen))
