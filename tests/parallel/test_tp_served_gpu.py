"""`loraplex compute --tensor-parallel-size 2` on two GPUs: the warm-up captures the decode graphs on
both ranks in lock step (their NCCL all-reduces pair up), and a base and an adapter request stream
the single-GPU engine's tokens (float32: the ranks' partial sums differ from one GPU's only in
rounding, far below this seeded model's top-2 logit gaps)."""
from __future__ import annotations

import re

import pytest
import torch

from tp_served import serve_tp2_and_generate

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_served_tp2_on_two_gpus_captures_graphs_on_every_rank(tmp_path):
    got, want, codes, output, _stats = serve_tp2_and_generate(tmp_path, "cuda", max_tokens=24)
    print(output)
    assert got == {"base": want[0], "lora": want[1]}, output[-4000:]
    assert want[0] != want[1]
    assert codes == [0, 0], output[-4000:]
    follower = re.search(r"tensor parallel rank 1: captured (\d+) decode graphs", output)
    assert follower is not None and int(follower.group(1)) > 0, output[-4000:]
