"""The decode graphs' L2 prefetch plan: at named points of a layer, launch `kernels.l2_prefetch` on a side stream
for a later projection's weight rows, so that its loads hit the L2 (the kernel module says why).

A plan is a list of rules `point:target:start-end` (LORAPLEX_L2_PREFETCH, comma separated; off when unset):
- point: where in layer i the prefetch is launched, after the launch before it on the main stream completes:
  `pre_qkv` (after the norm), `post_qkv` (after q/k/v, beside RoPE + cache and attention), `pre_o` (after
  attention), `pre_gate_up` (after the norm after o), `post_gate_up` (beside the SwiGLU), `pre_down`;
- target: a projection of layer i (`qkv`, `o`, `gate_up`, `down`), or of layer i + 1 with `+1` after it;
- start-end: the fraction of its output rows (features) to prefetch, `0-0.5`, or just `0.5` for `0-0.5`; a
  quantized weight's scales and offsets (one [groups, N] array each) come with a range that starts at 0.
Each point's chunk table is built once per layer (a few KB of device memory) and replayed by the graph.
Where the GPU cannot run the prefetch (before sm_90, the interpreter) a plan does nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from compute_service.engine.model import LayerWeights

ENV = "LORAPLEX_L2_PREFETCH"
POINTS = ("pre_qkv", "post_qkv", "pre_o", "pre_gate_up", "post_gate_up", "pre_down")
TARGETS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class Rule:
    point: str
    target: str
    next_layer: bool
    start: float
    end: float


def parse_plan(text: str) -> list[Rule]:
    """Rules from `text` (the module's syntax); a ValueError names the variable, the rule and what is wrong."""
    rules = []
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            continue
        fields = raw.split(":")
        if len(fields) != 3:
            raise ValueError(f"{ENV}: rule {raw!r} is not point:target:start-end")
        point, target, span = fields
        next_layer = target.endswith("+1")
        target = target.removesuffix("+1")
        if point not in POINTS:
            raise ValueError(f"{ENV}: rule {raw!r}: point must be one of {', '.join(POINTS)}")
        if target not in TARGETS:
            raise ValueError(f"{ENV}: rule {raw!r}: target must be one of {', '.join(TARGETS)} (+1: the next layer's)")
        try:
            bounds = [float(v) for v in span.split("-")]
        except ValueError:
            raise ValueError(f"{ENV}: rule {raw!r}: the span must be start-end fractions, e.g. 0-0.5") from None
        start, end = (0.0, bounds[0]) if len(bounds) == 1 else bounds if len(bounds) == 2 else (1.0, 0.0)
        if not 0.0 <= start < end <= 1.0:
            raise ValueError(f"{ENV}: rule {raw!r}: the span must satisfy 0 <= start < end <= 1")
        rules.append(Rule(point, target, next_layer, start, end))
    return rules


def linear_ranges(linear: Any, start: float, end: float) -> list[tuple[int, int]]:
    """(address, bytes) ranges of rows [start, end) (fractions) of a projection's weight: a dense `Linear`'s
    weight rows, or a `QuantLinear`'s packed words' rows (and its whole scales and offsets where start is 0)."""
    from kernels.l2_prefetch import tensor_rows

    packed = getattr(linear, "packed", None)
    if packed is None:
        return [tensor_rows(linear.weight, start, end)]
    ranges = [tensor_rows(packed.words, start, end)]
    if start == 0.0:
        ranges += [tensor_rows(packed.scales, 0.0, 1.0), tensor_rows(packed.offsets, 0.0, 1.0)]
    return ranges


def plan_tables(layers: list[LayerWeights], rules: list[Rule], programs: int,
                device: torch.device) -> dict[tuple[int, str], torch.Tensor]:
    """{(layer, point): chunk table} of a plan: per layer and point, the ranges of every rule there, in one table of
    chunks spread over about `programs` programs (`kernels.l2_prefetch.chunk_table`)."""
    from kernels.l2_prefetch import chunk_table

    tables = {}
    for i in range(len(layers)):
        by_point: dict[str, list[tuple[int, int]]] = {}
        for r in rules:
            j = i + 1 if r.next_layer else i
            if j < len(layers):
                by_point.setdefault(r.point, []).extend(linear_ranges(getattr(layers[j], r.target), r.start, r.end))
        for point, ranges in by_point.items():
            tables[(i, point)] = chunk_table(ranges, programs, device)
    return tables


class L2Prefetcher:
    """Launches a plan's prefetches in a captured forward (`at`), joined back into the main stream (`join`)."""

    def __init__(self, tables: dict[tuple[int, str], torch.Tensor], device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.tables = tables
        self._forked = False

    def at(self, i: int, point: str) -> None:
        """Launches layer i's prefetch at `point` (if the plan has one) on the side stream, after the main stream's
        work so far."""
        from kernels.l2_prefetch import l2_prefetch

        table = self.tables.get((i, point))
        if table is None:
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            l2_prefetch(table)
        self._forked = True

    def join(self) -> None:
        """The main stream waits for the side stream's launches (a captured graph must join every fork)."""
        if self._forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self._forked = False


def prefetcher_for(layers: list[LayerWeights], device: torch.device) -> L2Prefetcher | None:
    """The plan LORAPLEX_L2_PREFETCH asks for on this device, or None (unset, or the device cannot run it)."""
    from kernels.l2_prefetch import supported

    rules = parse_plan(os.environ.get(ENV, ""))
    if not rules or not supported(device):
        return None
    programs = torch.cuda.get_device_properties(device).multi_processor_count
    return L2Prefetcher(plan_tables(layers, rules, programs, device), device)
