"""What a load kept quantized: format, bits and group sizes, dense layers, bytes (the start-up log line), and
the short form GetModelInfo reports (`describe_projections`)."""
from __future__ import annotations

import logging
from collections import Counter

import torch

from compute_service.engine.linear import Linear
from compute_service.engine.model import LAYER_PROJECTIONS, ModelWeights
from compute_service.engine.quant_linear import QuantLinear

log = logging.getLogger(__name__)

# 4-bit weights in groups under 128 (a Q4_0 / Q4_K GGUF's 32) decode slower than 16 bits at batch 32 and more:
# on the 8B shape (H200, bench/results/quant_decode_g32.json) groups of 32 are 1.07x / 1.05x / 0.89x / 0.66x the
# bf16 engine at batch 1 / 8 / 32 / 64 (groups of 128: 1.63x / 1.59x / 1.23x / 1.08x; groups of 64 take neither
# pair-codes path, not measured). Small models' steps are launch-bound, so it matters from about this size.
SLOW_GROUPS_MIN_BF16_BYTES = 4 * 2**30


class QuantSummary:
    """Collects each base projection as it is built; `log()` reports them."""

    def __init__(self, format_name: str) -> None:
        self.format_name = format_name
        self.kinds: Counter[str] = Counter()          # "4-bit group 32" -> projections
        self.dense: list[str] = []
        self.quantized_bytes = 0
        self.dense_bytes = 0
        self.bf16_bytes = 0                           # what every projection would take in bf16
        self.mlp_ordered = 0                          # layers whose gate/up rows take down's act-order

    def add(self, name: str, layer: Linear | QuantLinear, why_dense: str = "", stored_order: bool = False) -> None:
        """`stored_order`: an act-order weight whose input arrives in its stored order (down under
        `mlp_order.py`), counted as act-order."""
        self.bf16_bytes += 2 * layer.in_features * layer.out_features
        self.mlp_ordered += int(stored_order)
        if isinstance(layer, QuantLinear):
            act_order = layer.act_order or stored_order
            self.kinds[f"{layer.bits}-bit group {layer.group_size}" + (" act-order" if act_order else "")] += 1
            self.quantized_bytes += layer.nbytes
        else:
            self.dense.append(f"{name} ({why_dense})" if why_dense else name)
            self.dense_bytes += layer.nbytes

    @property
    def num_quantized(self) -> int:
        return sum(self.kinds.values())

    @property
    def num_projections(self) -> int:
        return self.num_quantized + len(self.dense)

    @property
    def total_bytes(self) -> int:
        return self.quantized_bytes + self.dense_bytes

    @property
    def kinds_text(self) -> str:
        """e.g. "4-bit group 32: 120" ("" when none was kept quantized)."""
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.kinds.items()))

    def _four_bit_groups(self) -> dict[str, int]:
        """The 4-bit kinds kept (e.g. "4-bit group 128 act-order") and their group sizes."""
        return {k: int(k.split()[2]) for k in self.kinds if k.startswith("4-bit group ")}

    def slow_groups_note(self) -> str:
        """A warning for large models kept 4-bit in groups under 128 ("" otherwise)."""
        small = sorted(k for k, g in self._four_bit_groups().items() if g < 128)
        if not small or self.bf16_bytes < SLOW_GROUPS_MIN_BF16_BYTES:
            return ""
        return (f"{', '.join(small)} projections ({self.bf16_bytes / 2**30:.1f} GiB in bf16): decode steps of many "
                "sequences run slower than the same model in 16 bits (8B in groups of 32, H200: 1.05x at batch 8, "
                "0.89x at 32, 0.66x at 64; groups of 128 are faster); --quantization none trades the memory saved for "
                "that speed")

    def fp16_pairs_note(self, dtype: torch.dtype, device: torch.device) -> str:
        """A note where decoding one sequence sums 4-bit codes times x in float16 pairs (`kernels.quant_h2`: bf16
        on a GPU, groups of 128 and more): its range limit and the switch that lifts it ("" otherwise)."""
        from kernels.quant_h2 import ENV, RANGE, fp16_pairs_enabled
        from kernels.quant_pack import paired_layout

        paired = [k for k, g in self._four_bit_groups().items() if paired_layout(4, g)]
        if not paired or dtype != torch.bfloat16 or torch.device(device).type != "cuda" or not fp16_pairs_enabled():
            return ""
        return (f"one-row steps on the {', '.join(sorted(paired))} projections sum codes times x in float16 pairs: "
                f"projection inputs must stay below {RANGE} in magnitude (beyond it the output can be inf); "
                f"{ENV}=0 in the compute process's environment keeps fp32 products (slower at batch 1)")

    def log(self, dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
        dense = ", ".join(self.dense[:6]) + (f" and {len(self.dense) - 6} more" if len(self.dense) > 6 else "")
        log.info("quantized base (%s): %d of %d projections kept quantized (%s)%s; projection weights %.1f MiB "
                 "(%.1f MiB quantized + %.1f MiB dense) vs %.1f MiB in bf16", self.format_name, self.num_quantized,
                 self.num_projections, self.kinds_text or "none",
                 f"; dense: {dense}" if dense else "", self.total_bytes / 2**20,
                 self.quantized_bytes / 2**20, self.dense_bytes / 2**20, self.bf16_bytes / 2**20)
        if self.mlp_ordered:
            log.info("act-order down projections: %d layers keep gate/up's rows in down's stored order (act is "
                     "computed in it, no gather; LORAPLEX_MLP_ORDER=0 turns this off)", self.mlp_ordered)
        note = self.slow_groups_note()
        if note:
            log.warning(note)
        pairs = self.fp16_pairs_note(dtype, device) if dtype is not None and device is not None else ""
        if pairs:
            log.info(pairs)


def describe_projections(weights: ModelWeights, dtype: torch.dtype) -> str:
    """How the base projections are held, for GetModelInfo's `weights`: the dtype's name when every one is
    dense, else e.g. "4-bit group 32: 120 of 120 projections (63.3 MiB; 202.5 MiB in bfloat16)" (a tensor-
    parallel rank's own shards)."""
    summary = QuantSummary("")
    for i, layer in enumerate(weights.layers):
        for name in LAYER_PROJECTIONS:
            stored_order = name == "down" and layer.mlp_order is not None
            summary.add(f"{i}.{name}", getattr(layer, name), stored_order=stored_order)
    dtype_name = str(dtype).removeprefix("torch.")
    if not summary.num_quantized:
        return dtype_name
    dense = f", {len(summary.dense)} dense in {dtype_name}" if summary.dense else ""
    return (f"{summary.kinds_text} of {summary.num_projections} projections{dense} ({summary.total_bytes / 2**20:.1f} "
            f"MiB; {summary.bf16_bytes * dtype.itemsize / 2 / 2**20:.1f} MiB in {dtype_name})")
