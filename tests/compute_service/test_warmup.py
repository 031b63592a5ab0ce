"""Start-up warm-up: health gating, a clean state afterwards, one step per launch class, nothing compiled later."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import types

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from compute_service.build import build_runtime
from compute_service.config import ComputeConfig
from compute_service.engine.sampling_params import SamplingParams
from compute_service.server import WarmupGate
from compute_service.servicer import ComputeServicer
from compute_service.warmup import compiled_kernels, describe_compiled, warm_up
from compute_service.warmup_plan import make_plan
from compute_helpers import random_adapter
from loraplex.serving import run_server
from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc


def _runtime(model_dir, device: str = "cpu", **kw):
    cfg = ComputeConfig(model=str(model_dir), device=device, max_model_len=96, kv_cache_bytes=1 << 20,
                        lora_gpu_cache_bytes=8 << 20, max_lora_rank=64, **kw)
    return cfg, build_runtime(cfg, None, capture_graphs=False)


def test_plan_runs_one_step_per_class_and_covers_every_token_count():
    classes = {t: ("big" if t > 100 else "small", t > 250) for t in range(1, 401)}   # a kernel's choices by T
    plan = make_plan(400, [1, 2, 4, 8, 16], classes.__getitem__)
    covered = {(t % 16 == 0, classes[t]) for t in plan.decode_buckets + plan.prefill_tokens}
    assert all((t % 16 == 0, classes[t]) in covered for t in range(1, 401))
    assert len({(t % 16 == 0, classes[t]) for t in plan.prefill_tokens}) == len(plan.prefill_tokens)
    assert plan.prefill_tokens == [101, 112, 251, 256]       # the decode buckets already cover T <= 100
    assert plan.base_prefill_tokens == [1, 16]               # prefill attention: both divisibility classes



def test_plan_covers_only_the_token_counts_steps_launch_with():
    """Steps of up to 128 tokens run as prefill graphs padded to buckets: only the buckets and counts above
    128 are planned, and a class seen only between buckets is not."""
    from compute_service.engine.prefill_graphs import prefill_buckets
    buckets = prefill_buckets(128)
    pad = lambda t: next((b for b in buckets if b >= t), t)   # noqa: E731
    classes = {t: ("odd" if t == 37 else "big" if t > 100 else "small", t > 250) for t in range(1, 401)}
    plan = make_plan(400, [1, 2, 4, 8, 16], classes.__getitem__, pad)
    assert 37 not in plan.prefill_tokens and plan.prefill_tokens == [128, 129, 251, 256]
    assert all(t in buckets or t > 128 for t in plan.prefill_tokens + plan.base_prefill_tokens)

def test_warm_up_runs_real_steps_and_leaves_nothing_behind(tiny_model_dir):
    _, rt = _runtime(tiny_model_dir)
    arrivals = rt.engine._arrivals
    report = warm_up(rt, "full")
    assert report.mode == "full" and report.adapter_ranks == [8, 64] and report.plan is not None
    assert rt.engine._arrivals == arrivals + 3            # the three real requests went through the engine
    stats, pool = rt.engine.stats(), rt.slots.stats()
    assert stats.num_kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    assert pool.pages_used == 0 and pool.resident_keys == [] and pool.num_evictions == 0
    assert not rt.slots.timings
    assert all(int(k.abs().sum()) == 0 and int(v.abs().sum()) == 0 for k, v in rt.engine.runner.kv_caches)
    # The pool serves a user's adapter in the slot the warm-up used, with the same result as a fresh pool.
    adapter = random_adapter(rt.engine.spec, 8, seed=5)
    rt.engine.add_adapter("user", adapter)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    warmed = rt.engine.generate([[3, 4, 5, 6]], params, ["user"])
    _, fresh = _runtime(tiny_model_dir)
    fresh.engine.add_adapter("user", adapter)
    assert warmed == fresh.engine.generate([[3, 4, 5, 6]], params, ["user"])


async def _check(stub) -> int:
    return (await stub.Check(health_pb2.HealthCheckRequest(service="loraplex.v1.Compute"))).status


def test_health_is_not_serving_and_compute_refused_until_warm_up_finished(tiny_model_dir, free_port):
    cfg, rt = _runtime(tiny_model_dir)
    gate = WarmupGate()

    async def main():
        release = asyncio.Event()

        async def ready() -> None:          # the server's warm-up step, held until the test has looked
            await release.wait()
            await asyncio.to_thread(warm_up, rt, "full")
            rt.runner.start()
            gate.open()

        def register(server):
            compute_pb2_grpc.add_ComputeServicer_to_server(ComputeServicer(rt, cfg.max_model_len), server)
            return ["loraplex.v1.Compute"]

        server = asyncio.create_task(run_server("compute_service", f"127.0.0.1:{free_port}", register,
                                                interceptors=[gate], ready=ready))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            compute = compute_pb2_grpc.ComputeStub(ch)
            req = compute_pb2.GenerateTokensRequest(request_id="r", input_ids=[5, 6, 7],
                                                    sampling=common_pb2.SamplingParams(max_tokens=3))
            for _ in range(100):
                try:
                    before = await _check(health)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in compute.GenerateTokens(req):
                    pass
            release.set()
            while (after := await _check(health)) != health_pb2.HealthCheckResponse.SERVING:
                await asyncio.sleep(0.02)
            tokens = [t async for m in compute.GenerateTokens(req) for t in m.token_ids]
        os.kill(os.getpid(), signal.SIGTERM)      # run_server's own graceful stop
        await server
        await rt.runner.stop()
        return before, refused.value, after, tokens

    before, refused, after, tokens = asyncio.run(main())
    assert before == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in refused.details()
    assert after == health_pb2.HealthCheckResponse.SERVING and len(tokens) == 3


def _warm_runtime_with_adapters(model_dir, **kw):
    """A CUDA runtime warmed up (eager: no graphs), Triton's compiled programs counted, three adapters added."""
    _, rt = _runtime(model_dir, device="cuda", max_num_batched_tokens=256, max_num_seqs=16, **kw)
    report = warm_up(rt, "full")
    before = compiled_kernels()
    assert before and before == report.compiled_kernels
    for i in range(3):
        rt.engine.add_adapter(f"a{i}", random_adapter(rt.engine.spec, (8, 16, 64)[i], seed=i, dtype=torch.bfloat16))
    return rt, before


@pytest.mark.gpu
def test_no_request_compiles_a_kernel_after_warm_up(tiny_model_dir):
    """Requests of every size, with and without adapters, mixed, decode: Triton compiles nothing new."""
    rt, before = _warm_runtime_with_adapters(tiny_model_dir)
    engine = rt.engine
    rng = random.Random(0)
    for wave in range(6):
        n = rng.randint(1, 16)
        prompts = [[rng.randrange(engine.spec.vocab_size) for _ in range(rng.randint(1, 90))] for _ in range(n)]
        keys = [rng.choice([None, "a0", "a1", "a2"]) for _ in range(n)]
        params = SamplingParams(max_tokens=rng.randint(1, 5), temperature=rng.choice([0.0, 0.8]), seed=wave,
                                ignore_eos=True)
        engine.generate(prompts, params, keys)
    torch.cuda.synchronize()
    assert compiled_kernels() == before


@pytest.mark.gpu
def test_no_step_size_compiles_a_kernel_after_warm_up_on_a_4bit_base(tiny_model_dir, tmp_path):
    """A 4-bit base on the kernels (q/k/v, o, gate/up; down's 80 in features are no multiple of the group):
    their tiles and K splits follow the step's token count, and every count from 1 to past the GEMM switch,
    with and without an adapter, compiles nothing new after the warm-up."""
    from compute_service.engine.quant_formats.export import quantize_checkpoint
    from compute_service.warmup_plan import quantized_projections

    folder = quantize_checkpoint(tiny_model_dir, tmp_path / "w4", bits=4, group_size=32, progress=False).out
    rt, before = _warm_runtime_with_adapters(folder, quantization="keep")
    engine = rt.engine
    assert len(quantized_projections(engine.runner.model)) >= 3
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for t in range(1, 80):
        engine.generate([[(7 * t + i) % engine.spec.vocab_size for i in range(t)]], params, [(None, "a1")[t % 2]])
    torch.cuda.synchronize()
    assert compiled_kernels() == before



def test_quantized_projections_are_told_apart_by_what_their_launches_depend_on():
    """The warm-up's dry runs visit one projection of each shape / bits / group / GEMM switch, and the plan's
    cache key names them; a dense model has none."""
    from compute_service.engine.quant_linear import QuantLinear
    from compute_service.engine.quantized import quantize_rtn
    from compute_service.warmup_plan import describe_quantized, joined, quantized_projections

    def quant(n, k, group=32, **kw):
        kw.setdefault("use_kernel", True)
        return QuantLinear(quantize_rtn(torch.randn(n, k), 4, group), None, torch.device("cpu"), **kw)
    a, b, c = quant(64, 64), quant(96, 64), quant(64, 64, dense_min_tokens=9)
    layers = [types.SimpleNamespace(qkv=a, o=quant(64, 64), gate_up=b, down=c),
              types.SimpleNamespace(qkv=quant(64, 64), o=a, gate_up=quant(96, 64), down=torch.nn.Linear(64, 64))]
    model = types.SimpleNamespace(weights=types.SimpleNamespace(layers=layers))
    assert quantized_projections(model) == [a, b, c]
    assert describe_quantized(model) == "64x64:4b:g32:d65;96x64:4b:g32:d65;64x64:4b:g32:d9"
    dense = types.SimpleNamespace(weights=types.SimpleNamespace(layers=[types.SimpleNamespace(
        qkv=quant(64, 64, use_kernel=False), o=None, gate_up=None, down=None)]))
    assert quantized_projections(dense) == [] and describe_quantized(dense) == ""
    assert joined(lambda t: ("x",) * t, lambda t: (), lambda t: (t,))(2) == ("x", "x", 2)


def test_dry_runs_hand_a_projection_the_sums_the_forward_hands_it():
    """The dry runs call each quantized projection as the fused forward does: with x's slice sums where the
    kernel before it writes them (q/k/v and gate/up after a norm, down after the SwiGLU), without for o (its
    call launches their sums); one projection of a shape stands for both cases only when they agree."""
    from compute_service.engine.model import LlamaModel
    from compute_service.engine.quant_linear import QuantLinear
    from compute_service.engine.quantized import quantize_rtn
    from compute_service.warmup_plan import _projection_calls

    def quant(n, k):
        return QuantLinear(quantize_rtn(torch.randn(n, k), 4, 32), None, torch.device("cpu"), use_kernel=True)
    square, wide = quant(64, 64), quant(96, 64)
    layers = [types.SimpleNamespace(qkv=wide, o=square, gate_up=quant(128, 64), down=quant(64, 64))]
    model = types.SimpleNamespace(weights=types.SimpleNamespace(layers=layers), fused=True, reduce_add_norm=None)
    model.writes_sums = types.MethodType(LlamaModel.writes_sums, model)
    calls = _projection_calls(model)
    assert [(p.out_features, written) for p, written, _ in calls] == \
        [(96, True), (64, False), (128, True), (64, True)]
    assert calls[1][0] is square and not any(ordered for _, _, ordered in calls)
    model.reduce_add_norm = object()        # tensor parallel: the norms write no sums
    assert [written for _, written, _ in _projection_calls(model)] == [False, False, False, True]
    model.fused = False
    assert [written for _, written, _ in _projection_calls(model)] == [False, False, False]   # o and down: one
    assert [written for _, written, _ in _projection_calls(types.SimpleNamespace(weights=model.weights))] == \
        [False, False, False]


def test_dry_runs_hand_an_act_order_projection_x_in_its_order_where_the_forward_does(monkeypatch):
    """An act-order projection whose x a norm or the SwiGLU writes gets it in its own channel order
    (`LlamaModel.writes_ordered`), so its dry run calls it ordered (no gather); o, and the norms under tensor
    parallelism, gather; LORAPLEX_ORDERED_X=0 gathers everywhere. Such a projection does not stand for a plain
    one of its shape."""
    from compute_service.engine.model import LlamaModel
    from compute_service.engine.quant_linear import QuantLinear
    from compute_service.engine.quantized import QuantizedWeight, quantize_rtn
    from compute_service.warmup_plan import _projection_calls

    def quant(n, k, act_order):
        q = quantize_rtn(torch.randn(n, k), 4, 32)
        perm = torch.randperm(k) if act_order else None
        return QuantLinear(QuantizedWeight(q.q, q.scales, q.offsets, 4, 32, perm), None, torch.device("cpu"),
                           use_kernel=True)
    layers = [types.SimpleNamespace(qkv=quant(96, 64, True), o=quant(64, 64, True), gate_up=quant(128, 64, True),
                                    down=quant(64, 64, False)),
              types.SimpleNamespace(qkv=quant(96, 64, True), o=quant(64, 64, True), gate_up=quant(128, 64, True),
                                    down=quant(64, 64, True))]
    model = types.SimpleNamespace(weights=types.SimpleNamespace(layers=layers), fused=True, reduce_add_norm=None,
                                  _ordered_x_on=True)
    model.writes_sums = types.MethodType(LlamaModel.writes_sums, model)
    model.writes_ordered = types.MethodType(LlamaModel.writes_ordered, model)
    calls = _projection_calls(model)
    assert [(p.out_features, p.act_order, ordered) for p, _, ordered in calls] == \
        [(96, True, True), (64, True, False), (128, True, True), (64, False, False), (64, True, True)]
    model.reduce_add_norm = object()        # tensor parallel: the all-reduce + norm writes x in the model's order
    assert [ordered for _, _, ordered in _projection_calls(model)] == [False, False, False, False, True]
    model.reduce_add_norm, model._ordered_x_on = None, False
    assert not any(ordered for _, _, ordered in _projection_calls(model))


def test_start_up_line_names_the_compiled_programs_or_says_there_are_none():
    assert describe_compiled(12) == "12 Triton programs"
    assert "None" not in describe_compiled(None) and "no compiled Triton programs" in describe_compiled(None)


def _counted_kernel(x_ptr):        # source for a JITFunction built by hand below
    pass


def test_a_kernel_one_module_imports_from_another_is_counted_once(monkeypatch):
    """quant_matmul imports the 4-bit kernels' JIT functions by name: their programs count once, not per module
    that holds the name (the compile pool's GPU test compares this count with the programs it compiled)."""
    from triton.runtime.jit import JITFunction

    before = compiled_kernels() or 0
    fn = JITFunction(_counted_kernel)
    fn.device_caches = {0: ({"program a": None, "program b": None},)}     # two programs on device 0
    for name in ("kernels._counted_here", "kernels._counted_there"):
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(kernel=fn))
    assert compiled_kernels() == before + 2
