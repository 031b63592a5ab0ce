"""`loraplex compute --tensor-parallel-size 2` on CPU, as real processes with a host cache: a base and
an adapter request stream the same tokens as the single-process engine; stopping ends every rank."""
from __future__ import annotations

import re

import pytest

from tp_served import serve_tp2_and_generate

pytestmark = pytest.mark.slow


def test_served_tp2_streams_the_single_process_tokens(tmp_path):
    got, want, codes, output, stats = serve_tp2_and_generate(
        tmp_path, "cpu", extra=("--lora-gpu-cache-bytes", str(4 << 20), "--max-resident-adapters", "3"))
    assert got == {"base": want[0], "lora": want[1]}, output
    assert want[0] != want[1]
    assert codes == [0, 0], output
    assert "tensor parallel group of 2 ranks" in output
    # the pool is the service's (its byte budget and slot limit), not the engine's max_loras sizing
    assert 3.5 * 2**20 < stats.adapter_pool_bytes_total <= 4 << 20, stats
    assert "rank 1: adapter pool of" in output and "up to 3 resident adapters" in output
    # the follower staged every adapter (the warm-up's and the request's) when rank 0 did, none on the
    # step that first used it
    ahead = re.search(r"rank 1: stop after \d+ steps \(adapters: (\d+) staged ahead, 0 sent whole", output)
    assert ahead is not None and int(ahead.group(1)) >= 1, output


def test_served_tp2_full_warmup_compiles_on_rank0_alone(tmp_path):
    """The full warm-up's compile pass (forwards on threads, outside the engine) runs on rank 0 with its
    all-reduces skipped: without that its first forward would wait on a peer that never joins, and the start
    would fail at the group's timeout. The served tokens are the single-process engine's after it."""
    got, want, codes, output, _stats = serve_tp2_and_generate(tmp_path, "cpu", extra=("--warmup", "full"))
    assert got == {"base": want[0], "lora": want[1]}, output
    assert codes == [0, 0], output
    assert "the compile pass runs on rank 0 alone" in output, output
    assert re.search(r"warm-up: kernels compiled in [\d.]+ s", output), output


def test_serve_passes_tensor_parallel_size_to_compute():
    from loraplex.cli.main import build_parser
    from loraplex.cli.serve import service_args

    args = build_parser().parse_args(["serve", "--device", "cpu", "--tensor-parallel-size", "2"])
    _cache, compute = service_args(args, "")
    assert compute[compute.index("--tensor-parallel-size") + 1] == "2"
    _cache, compute = service_args(build_parser().parse_args(["serve"]), "")
    assert "--tensor-parallel-size" not in compute
