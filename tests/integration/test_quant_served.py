"""A quantized checkpoint served for real on the CPU: `loraplex quantize` writes a 4-bit AWQ folder of a
tiny Llama (or a GPTQ act-order one is written), `loraplex compute --quantization keep` (with a host cache
service) serves it kept quantized, and a base and an adapter request stream the tokens the in-process engine
gives on the same folder."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from compute_service.build import zero_kv_cache
from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from compute_service.engine.quant_linear import QuantLinear
from loraplex.cache_client import CacheClient
from loraplex.procs import start_service
from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc
from parallel.tp_helpers import random_adapter, save_tiny_llama

pytestmark = [pytest.mark.serial, pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT = [5, 6, 7, 8, 9]


async def generate(cache_address: str, compute_address: str, adapter) -> dict[str, object]:
    async with CacheClient(cache_address) as client:
        await client.put_adapter(adapter, 5)
    async with grpc.aio.insecure_channel(compute_address) as ch:
        stub = compute_pb2_grpc.ComputeStub(ch)
        out = {}
        for rid, ref in (("base", None), ("lora", compute_pb2.AdapterRef(task_id=5))):
            req = compute_pb2.GenerateTokensRequest(
                request_id=rid, input_ids=PROMPT, adapter=ref,
                sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True))
            out[rid] = [t async for m in stub.GenerateTokens(req) for t in m.token_ids]
        out["weights"] = (await stub.GetModelInfo(compute_pb2.ComputeModelInfoRequest())).model.weights
        return out


def make_checkpoint(kind: str, dense, folder) -> None:
    """`loraplex quantize`'s AWQ folder, or a GPTQ act-order folder (channels quantized in a random order per
    input, `g_idx` naming their groups) written from the format's definition."""
    if kind == "gptq-act-order":
        from transformers import AutoModelForCausalLM

        from engine.quant_helpers import write_gptq_folder
        write_gptq_folder(AutoModelForCausalLM.from_pretrained(str(dense)), dense, folder, 4, 16, act_order=True)
        return
    made = subprocess.run([sys.executable, "-m", "loraplex.cli.main", "quantize", str(dense), str(folder),
                           "--format", "awq", "--group-size", "16", "--quiet"], capture_output=True, text=True,
                          timeout=300)
    assert made.returncode == 0, made.stderr


@pytest.mark.parametrize("kind,fmt,group", [("awq", "awq", "4-bit group 16"),
                                            ("gptq-act-order", "gptq", "4-bit group 16 act-order")])
def test_quantized_tiny_model_serves_base_and_adapter(tmp_path, kind, fmt, group):
    dense = save_tiny_llama(tmp_path / "dense", 4, 2, seed=11)
    folder = tmp_path / kind
    make_checkpoint(kind, dense, folder)
    limits = {"max_model_len": 96, "kv_cache_bytes": 1 << 20, "dtype": "float32", "quantization": "keep"}
    ref = LLMEngine(EngineConfig(model=str(folder), lora_backend="torch", **limits))  # type: ignore[arg-type]
    assert isinstance(ref.loaded.model.weights.layers[0].gate_up, QuantLinear)
    zero_kv_cache(ref)
    adapter = random_adapter(ref.spec, (1, 2, 3, 4, 5, 6, 7), 8, seed=3)
    services: list = []
    try:
        services.append(start_service("cache", ["cache", "--listen", "127.0.0.1:0", "--model", str(folder)]))
        flags = {"--cache-address": services[0].address, "--model": str(folder), "--device": "cpu",
                 "--max-lora-rank": "64", **{"--" + k.replace("_", "-"): str(v) for k, v in limits.items()}}
        services.append(start_service("compute", ["compute", "--listen", "127.0.0.1:0",
                                                  *[x for kv in flags.items() for x in kv]]))
        got = asyncio.run(generate(services[0].address, services[1].address, adapter))
    finally:
        codes = [svc.stop() for svc in reversed(services)]
    compute = services[1] if len(services) > 1 else None
    output = compute.output() if compute is not None else ""
    ref.add_adapter("a", adapter)
    want = ref.generate([PROMPT, PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                        [None, "a"])
    weights = got.pop("weights")
    assert got == {"base": want[0], "lora": want[1]}, output
    assert str(weights).startswith(f"{group}: 8 of 8 projections ("), weights        # GetModelInfo says it
    assert want[0] != want[1]
    assert codes == [0, 0], output
    assert f"{fmt} checkpoint kept quantized on the CPU (--quantization keep)" in output
    assert f"quantized base ({fmt}): 8 of 8 projections kept quantized ({group}: 8)" in output
