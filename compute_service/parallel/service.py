"""The served compute service over a tensor-parallel group: rank 0 is the service, the followers are
child processes it starts (one per further rank), each running `follow` until rank 0 stops.

On CPU the group talks gloo; on GPUs NCCL (activations) and gloo (step inputs). The warm-up drives
the followers too: its graph capture is broadcast as a command so every rank captures in lock step,
and its threaded compile pass is skipped (see compute_service/warmup.py).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import os
import socket

import torch

from compute_service.config import ComputeConfig
from compute_service.engine.config import EngineConfig
from compute_service.parallel.engine import build_rank_engine
from compute_service.parallel.group import TensorParallelGroup, init_group
from compute_service.parallel.schedule import follow, release_graphs

log = logging.getLogger(__name__)
IDLE_TIMEOUT_S = 7 * 24 * 3600.0     # a follower waits this long for a step while the service idles


def _environment(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def _follower_main(config: ComputeConfig, ecfg: EngineConfig, rank: int, world: int, port: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    _environment(rank, world, port)
    group = init_group(ecfg.torch_device.type, control_timeout_s=IDLE_TIMEOUT_S)
    engine, slots = build_rank_engine(ecfg, group, config)
    try:
        follow(engine.runner, slots, group)  # type: ignore[arg-type]
    except RuntimeError as e:
        log.error("tensor parallel rank %d: group down (%s); exiting", rank, e)
        os._exit(1)
    release_graphs(engine.runner)
    group.close()


def start_group(config: ComputeConfig, ecfg: EngineConfig, world: int) -> TensorParallelGroup:
    """Starts ranks 1..world-1 as child processes and joins the group as rank 0."""
    if ecfg.torch_device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs; this host has "
                         f"{torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_follower_main, args=(config, ecfg, r, world, port), daemon=True,
                         name=f"loraplex-tp-rank{r}") for r in range(1, world)]
    for p in procs:
        p.start()
    _environment(0, world, port)
    group = init_group(ecfg.torch_device.type, control_timeout_s=IDLE_TIMEOUT_S)
    log.info("tensor parallel group of %d ranks: followers %s", world, [p.pid for p in procs])
    return group


def build_rank0_engine(config: ComputeConfig, ecfg: EngineConfig):  # type: ignore[no-untyped-def]
    """Rank 0's engine and slots for the service (followers started, group joined)."""
    ecfg = dataclasses.replace(ecfg, lora_backend="auto")
    group = start_group(config, ecfg, config.tensor_parallel_size)
    engine, slots = build_rank_engine(ecfg, group, config)

    def stop() -> None:
        try:
            engine.runner.stop()             # type: ignore[attr-defined]
            engine.runner.close()            # type: ignore[attr-defined]
            release_graphs(engine.runner.inner)  # type: ignore[attr-defined]
            group.close()
        except RuntimeError as e:
            log.warning("tensor parallel group: stop failed (%s)", e)
    atexit.register(stop)
    return engine, slots

