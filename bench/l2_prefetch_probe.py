"""What an L2-warm weight saves a one-row 4-bit projection (batch 1), per 8B shape: pick_config's one-row launch
after an RMSNorm that writes its x, as in a decode step, preceded by a ~GAP_US spin, with or without
`kernels.l2_prefetch` of the first fraction of its weight's rows launched before the spin (it lands in the L2
while the spin runs). The difference per launch is the most a prefetch of that fraction could save in a step,
where an idle window as long as the spin precedes the projection; the engine A/B
(`LORAPLEX_L2_PREFETCH`, compute_service/engine/l2_prefetch.py) shows what it saves there.

    python3 bench/l2_prefetch_probe.py --commit "$(git rev-parse --short HEAD)" --out bench/results/l2_prefetch_probe.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compute_service.engine.l2_prefetch import linear_ranges  # noqa: E402
from kernels.l2_prefetch import chunk_table, l2_prefetch  # noqa: E402
from kernels.quant_matmul import launch_split, pick_config, quant_matmul  # noqa: E402
from kernels.rms_norm import add_rms_norm  # noqa: E402
from quant_kernel_sweep import EPS, SHAPES_8B, graph_us, packed_copies  # noqa: E402
from run_header import gpu_run_header  # noqa: E402  (bench helpers)

GAP_US = 12.0
FRACTIONS = {"qkv": (0.5, 1.0), "o": (0.5, 1.0), "gate_up": (0.25, 0.5, 0.75), "down": (0.25, 0.5, 1.0)}


class _Packed:           # what linear_ranges reads of a QuantLinear
    def __init__(self, packed) -> None:
        self.packed = packed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    res: dict = gpu_run_header(dev, args.commit)
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    cycles = int(GAP_US * props.clock_rate / 1e3) if getattr(props, "clock_rate", 0) else int(GAP_US * 1980)
    res.update(rows=1, gap_us=GAP_US, spin_cycles=cycles, cases={})
    for name, (n, k) in SHAPES_8B.items():
        ws = packed_copies(n, k, 128, gen)
        cfg = pick_config(1, n, k, 4, sms, 128)
        src = torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16)
        norm_w = torch.ones(k, device=dev, dtype=torch.bfloat16)
        x = torch.empty_like(src)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        parts = torch.empty(max(1, launch_split(cfg, ws[0])), 1, n, device=dev)
        locks = torch.zeros(4096, dtype=torch.int32, device=dev)

        def step(w, table=None) -> None:
            if table is not None:
                l2_prefetch(table)
            torch.cuda._sleep(cycles)
            add_rms_norm(src, None, norm_w, EPS, x)
            quant_matmul(x, w, None, out, cfg, parts, locks, defer_split=True)

        empty = chunk_table([(src.data_ptr(), 16)], sms, dev)     # the baseline launches a prefetch of 16 bytes
        gap_us = graph_us([lambda: (torch.cuda._sleep(cycles), add_rms_norm(src, None, norm_w, EPS, x))] * len(ws))
        cold = graph_us([lambda w=w: step(w, empty) for w in ws]) - gap_us
        case = {"config": [cfg.block_n, cfg.split_k, cfg.tma_stages], "weight_mb": ws[0].nbytes / 2**20,
                "spin_and_norm_us": gap_us, "cold_us": cold, "warm": {}}
        for f in FRACTIONS[name]:
            tables = [chunk_table(linear_ranges(_Packed(w), 0.0, f), sms, dev) for w in ws]
            warm = graph_us([lambda w=w, t=t: step(w, t) for w, t in zip(ws, tables)]) - gap_us
            case["warm"][str(f)] = {"us": warm, "saving_us": cold - warm}
            print(f"{name:8s} {f:4.2f} of {case['weight_mb']:5.1f} MB prefetched: {cold:6.2f} -> {warm:6.2f} us",
                  flush=True)
        res["cases"][name] = case
        del ws
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
