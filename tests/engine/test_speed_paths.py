"""The fast paths give the same numbers as the clear ones.

- CPU (Triton interpreter): decode-only steps through the paged-attention
  decode kernel vs the padded-tile SDPA path, mixed adapters, both within the
  parity tolerance of PEFT's logits; the same with the contexts split.
- GPU: decode steps replayed from CUDA graphs (buckets, padding, LoRA metadata
  changing between replays, requests joining and leaving) vs the same engine
  run eagerly.
"""
from __future__ import annotations

import copy

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from helpers import TINY_DIMS, add_peft_adapters, record_calls, rel_err
from loraplex.formats import read_peft
from test_mixed_batch import ADAPTERS, REQUESTS
from test_parity import assert_peft_parity, run_collecting


@pytest.fixture(scope="module")
def peft_llama(tiny_models, tmp_path_factory):
    model, folder = tiny_models["llama"]
    peft_model = add_peft_adapters(copy.deepcopy(model), ADAPTERS)
    out = tmp_path_factory.mktemp("adapters_speed")
    peft_model.save_pretrained(out)
    return peft_model, folder, out


def _run(engine: LLMEngine, adapters_dir, seed: int, max_tokens: int = 6):
    for name in ADAPTERS:
        engine.add_adapter(name, read_peft(adapters_dir / name))
    g = torch.Generator().manual_seed(seed)
    reqs = {rid: (torch.randint(0, TINY_DIMS["vocab_size"], (n,), generator=g).tolist(), key)
            for rid, (key, n, _) in REQUESTS.items()}
    joins = {rid: step for rid, (_, _, step) in REQUESTS.items()}
    tokens, logits = run_collecting(engine, reqs, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                 ignore_eos=True), join_at=joins)
    return reqs, tokens, logits


def test_decode_kernel_split_context_matches_peft(peft_llama, monkeypatch):
    """fp32 on CPU (Triton interpreter) or on the GPU without graphs: decode steps whose contexts the kernel
    splits (the threshold lowered to 0: the tiny model holds 128 tokens) and merges across two chunks of 64,
    one request with an adapter, one without, both within the parity tolerance of PEFT's logits."""
    import kernels.paged_attention as pa
    from kernels import paged_split

    peft_model, folder, adapters_dir = peft_llama
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = LLMEngine(EngineConfig(model=str(folder), device=device, dtype="float32", block_size=16,
                                    max_num_batched_tokens=128, lora_backend="torch" if device == "cuda" else
                                    "kernels", max_loras=4, enforce_eager=True))
    engine.runner.decode_kernel = True
    for name in ADAPTERS:
        engine.add_adapter(name, read_peft(adapters_dir / name))
    monkeypatch.setattr(paged_split, "MIN_SPLIT_CONTEXT", 0)
    split_calls = record_calls(monkeypatch, pa, "split_counters", lambda *a: a)
    g = torch.Generator().manual_seed(7)
    reqs = {rid: (torch.randint(0, TINY_DIMS["vocab_size"], (n,), generator=g).tolist(), key)
            for rid, (key, n) in {"long_base": (None, 90), "long_b": ("B", 70)}.items()}
    tokens, logits = run_collecting(engine, reqs, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert split_calls, "no decode step was split"
    assert_peft_parity(peft_model, reqs, tokens, logits, 5)


@pytest.mark.parametrize("block_size,fused", [(4, False), (16, False), (4, True)])
def test_decode_kernel_matches_peft(peft_llama, block_size, fused, monkeypatch):
    """fp32 on CPU (Triton interpreter) or on the GPU without graphs: decode steps through the kernel,
    with and without the fused norm / RoPE + KV write / SwiGLU ops (prefill steps included)."""
    peft_model, folder, adapters_dir = peft_llama
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # On the GPU the LoRA kernels multiply fp32 in tf32 (~1e-3 off PEFT's fp32 logits, measured), so there
    # the torch LoRA backend keeps this fp32 check tight; on CPU the kernels backend runs its fp32 reference.
    backend = "torch" if device == "cuda" else "kernels"
    engine = LLMEngine(EngineConfig(model=str(folder), device=device, dtype="float32", block_size=block_size,
                                    max_num_batched_tokens=16, lora_backend=backend, max_loras=4,
                                    enforce_eager=True))
    engine.runner.decode_kernel = True          # on CPU: the Triton kernel in the interpreter
    engine.runner.model.fused = fused
    import kernels.paged_attention as pa

    calls = record_calls(monkeypatch, pa, "paged_attention_decode", lambda *a, **k: 1)
    reqs, tokens, logits = _run(engine, adapters_dir, seed=5)
    assert calls, "no decode-only step went through the kernel"
    assert_peft_parity(peft_model, reqs, tokens, logits, 6)


def _engine(folder, dtype: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype=dtype, block_size=4,
                                  lora_backend="kernels", max_loras=4, max_num_seqs=12, **kw))


def _check_fp32_pair(first, second) -> None:
    """Two fp32 runs of the same requests: each logits row within 1e-4 while both chose the same tokens."""
    (_, tok_a, log_a), (_, tok_b, log_b) = first, second
    for rid in log_a:
        for a, b, ta, tb in zip(log_a[rid], log_b[rid], tok_a[rid], tok_b[rid]):
            assert rel_err(b, a) < 1e-4, rid
            if ta != tb:
                break


def _check_against_fp32(ref, eager, graphs, slack: float = 2.0, margin: float = 1e-2) -> None:
    """bf16 graphs vs bf16 eager, both held against the fp32 eager run: while all three chose the same
    tokens, the graphs' logits are no further from fp32 than eager's (x slack, + margin). The two
    bf16 paths round in different places (padding buckets, the LoRA delta rounded before it is added in
    graphs), so they are not compared with each other directly."""
    (_, tok_r, log_r), (_, tok_e, log_e), (_, tok_g, log_g) = ref, eager, graphs
    for rid in log_r:
        for r, e, g, tr, te, tg in zip(log_r[rid], log_e[rid], log_g[rid], tok_r[rid], tok_e[rid], tok_g[rid]):
            err_e, err_g = rel_err(e, r), rel_err(g, r)
            assert err_g <= slack * err_e + margin, (rid, err_g, err_e)
            if not tr == te == tg:
                break


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_match_eager_gpu(peft_llama, dtype):
    _, folder, adapters_dir = peft_llama
    results = []
    for eager in (True, False):
        engine = _engine(folder, dtype, max_num_batched_tokens=16, enforce_eager=eager)
        results.append(_run(engine, adapters_dir, seed=7, max_tokens=10))
        assert (engine.runner.num_graph_steps > 0) != eager
    if dtype == "float32":
        (_, tok_e, log_e), (_, tok_g, log_g) = results
        assert tok_e == tok_g
        for rid in log_e:
            for a, b in zip(log_e[rid], log_g[rid]):
                assert rel_err(b, a) < 1e-4, rid
        return
    ref = _run(_engine(folder, "float32", max_num_batched_tokens=16, enforce_eager=True), adapters_dir, seed=7,
               max_tokens=10)
    _check_against_fp32(ref, *results)

@pytest.mark.gpu
def test_padded_eager_steps_match_unpadded_gpu(peft_llama):
    """Prefill/mixed steps above the prefill graphs' range run eagerly, padded to a multiple of 16 tokens by a
    sequence of padding in the scratch block (graphs on), vs the same steps unpadded (graphs off): fp32, the
    same tokens and logits."""
    _, folder, adapters_dir = peft_llama
    results = []
    for eager in (True, False):
        engine = _engine(folder, "float32", max_num_batched_tokens=64, prefill_graph_tokens=0, enforce_eager=eager)
        results.append(_run(engine, adapters_dir, seed=13, max_tokens=8))
        assert (engine.runner.num_padded_steps > 0) != eager
        assert engine.runner.launched_tokens(37) == (37 if eager else 48)
    _check_fp32_pair(*results)


def test_padding_an_eager_step_adds_one_sequence_in_the_scratch_block(tiny_models):
    """The padded step (CPU: the step's lists only): a multiple of 16 tokens, one more sequence of token 0 at
    positions 0.. in the scratch block, no adapter, the same rows sampled; a multiple of 16 is left as is."""
    from types import SimpleNamespace

    from compute_service.engine.model_runner import StepInputs

    _, folder = tiny_models["llama"]
    runner = LLMEngine(EngineConfig(model=str(folder), device="cpu", block_size=4)).runner
    step = StepInputs(list(range(1, 22)), list(range(21)), ["a"], [21], [21], [[0, 1, 2, 3, 4, 5]], [20])
    assert runner._padded(step) is step                        # graphs off: never padded
    runner.graphs = SimpleNamespace(scratch_block=99)
    padded = runner._padded(step)
    assert len(padded.input_ids) == 32 and padded.input_ids[21:] == [0] * 11
    assert padded.positions[21:] == list(range(11)) and padded.query_lens == [21, 11]
    assert padded.context_lens == [21, 11] and padded.tables[-1] == [99, 99, 99]
    assert padded.adapter_keys == ["a", None] and padded.sample_rows == [20]
    assert runner.num_padded_steps == 1
    even = StepInputs(list(range(32)), list(range(32)), [None], [32], [32], [[0] * 8], [31])
    assert runner._padded(even) is even


def test_prefill_buckets():
    from compute_service.engine.prefill_graphs import prefill_buckets
    assert prefill_buckets(0) == []
    assert prefill_buckets(16) == [16]
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(5) == [5]
    assert prefill_buckets(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert prefill_buckets(1000) == [16, 32, 64, 128, 256, 512, 768, 1000]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_graphs_match_eager_gpu(peft_llama, dtype):
    """Prefill and mixed steps replayed from prefill graphs (token counts padded to buckets 16/32/64,
    requests with and without adapters joining mid-run) vs the same steps run eagerly (decode graphs on
    in both, so only the prefill path differs); bf16 held against the fp32 run."""
    _, folder, adapters_dir = peft_llama
    results = []
    for prefill_tokens in (0, 64):
        engine = _engine(folder, dtype, max_num_batched_tokens=64, prefill_graph_tokens=prefill_tokens)
        results.append(_run(engine, adapters_dir, seed=11, max_tokens=8))
        assert (engine.runner.num_prefill_graph_steps > 0) == (prefill_tokens > 0)
    if dtype == "float32":
        _check_fp32_pair(*results)
        return
    ref = _run(_engine(folder, "float32", max_num_batched_tokens=64, enforce_eager=True), adapters_dir, seed=11,
               max_tokens=8)
    _check_against_fp32(ref, *results)
