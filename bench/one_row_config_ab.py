"""The engine's decode with other one-row kernel configs for some 8B projections: an A/B of pick_config's choices
where they count (each projection's launch in the engine's chain, after the kernel that writes its x), not in a
kernel sweep.

    ONE_ROW_CONFIGS="gate_up=128,8,2;down=64,16,0" python3 bench/one_row_config_ab.py --labels int4 --batches 1 \
        --no-kernels --out /tmp/ab.json

ONE_ROW_CONFIGS: `name=block_n,split_k,tma_stages[,num_warps[,scales_ahead]]` for any of qkv, o, gate_up, down (the
8B shapes, bench/quant_kernel_sweep.py's SHAPES_8B), separated by ";"; scales_ahead 1: the TMA-read kernel reads each
block's scales and offsets a block ahead. For one row of those shapes `kernels.quant_matmul.
pick_config` returns its own choice with those fields replaced (so the engine's launches, its split partials and the
sums' widths follow), then bench/quant_decode.py runs with the other arguments. Unset or empty: pick_config as is.
"""
from __future__ import annotations

import dataclasses
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import kernels.quant_matmul as quant_matmul  # noqa: E402
from quant_kernel_sweep import SHAPES_8B  # noqa: E402

ENV = "ONE_ROW_CONFIGS"


def parse(spec: str) -> dict[tuple[int, int], tuple[int, ...]]:
    """{(N, K): (block_n, split_k, tma_stages[, num_warps[, scales_ahead]])} from ONE_ROW_CONFIGS' text."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, vals = part.partition("=")
        fields = tuple(int(v) for v in vals.split(","))
        if name not in SHAPES_8B or len(fields) not in (3, 4, 5):
            raise SystemExit(f"{ENV}: {part!r} is not name=block_n,split_k,tma_stages[,num_warps[,scales_ahead]] for "
                             f"one of {', '.join(SHAPES_8B)}")
        out[SHAPES_8B[name]] = fields
    return out


def patch(wanted: dict[tuple[int, int], tuple[int, ...]]) -> None:
    """pick_config returns `wanted`'s fields for one row of those shapes."""
    picked = quant_matmul.pick_config

    def pick_config(T, N, K, *args, **kwargs):
        cfg = picked(T, N, K, *args, **kwargs)
        if T == 1 and (N, K) in wanted:
            bn, split, tma, *rest = wanted[(N, K)]
            cfg = dataclasses.replace(cfg, block_n=bn, split_k=split, tma_stages=tma,
                                      num_warps=rest[0] if rest else cfg.num_warps,
                                      scales_ahead=bool(rest[1]) if len(rest) > 1 else cfg.scales_ahead)
        return cfg
    quant_matmul.pick_config = pick_config


def main() -> None:
    spec = os.environ.get(ENV, "")
    patch(parse(spec))
    print(f"{ENV}={spec!r}", flush=True)
    sys.argv = [str(ROOT / "bench" / "quant_decode.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
