"""A follower that dies mid-generation brings rank 0 down with an error within seconds, never a hang."""
from __future__ import annotations

import os
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from compute_service.engine import EngineConfig, SamplingParams
from test_tp_cpu import free_port
from tp_helpers import save_tiny_llama

pytestmark = pytest.mark.serial


def worker(rank: int, port: int, folder: str, results) -> None:
    from compute_service.parallel.engine import build_rank_engine
    from compute_service.parallel.group import init_group

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    group = init_group("cpu", timeout_s=30)
    engine, slots = build_rank_engine(EngineConfig(model=folder, block_size=4, max_loras=2), group)
    if rank:
        msg = group.receive_step()               # one step, then the process dies without a word
        engine.runner.run_inputs(msg.step)
        os._exit(3)
    engine.add_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    t0 = time.monotonic()
    try:
        while engine.has_unfinished():
            engine.step()
        results["error"] = None
    except Exception as e:                       # the collective fails: the group must go down
        results["error"] = f"{type(e).__name__}: {e}"
        results["trace"] = traceback.format_exc()
    results["seconds"] = time.monotonic() - t0
    os._exit(0)


def test_dead_follower_fails_rank_zero_fast(tmp_path):
    folder = str(save_tiny_llama(tmp_path, 4, 2, seed=0))
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, port, folder, results)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=90)
        alive = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert not alive, "a rank hung after its peer died"
        assert procs[1].exitcode == 3
        assert results.get("error", "").startswith("ParallelGroupError: tensor parallel group down"), dict(results)
        assert results["seconds"] < 35, dict(results)
