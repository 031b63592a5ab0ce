"""The fields a GPU benchmark's results JSON starts with."""
from __future__ import annotations

import datetime

import torch

from multi_lora import copy_bandwidth


def gpu_run_header(dev: torch.device, commit: str) -> dict:
    """The fields a GPU benchmark's JSON starts with (device, commit, date, torch, the copy bandwidth of a
    2 GiB copy), printed in one line."""
    bw = copy_bandwidth(dev, 2**31)
    head = {"device": torch.cuda.get_device_name(dev), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "copy_bandwidth_Bps": bw}
    print(head["device"], f"copy {bw / 1e12:.2f} TB/s", flush=True)
    return head
