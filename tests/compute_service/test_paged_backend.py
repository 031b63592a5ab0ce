"""Both LoRA backends over the one pool against the adapters' own A/B rows, on the same tokens."""
from __future__ import annotations

import pytest
import torch
from compute_helpers import random_adapter

from compute_service.adapter_cache.backends import lora_backend_for
from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.engine.lora_backend import ALL_GROUPS
from compute_service.engine.spec import ModelSpec

SPEC = ModelSpec(architecture="llama", num_layers=2, hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=16,
                 intermediate_size=160, vocab_size=50, rms_norm_eps=1e-5, rope_theta=1e4,
                 max_position_embeddings=64, tie_word_embeddings=True)
GROUPS = {"qkv": ([96, 32, 32], (1, 2, 3)), "o": ([96], (4,)), "gate_up": ([160, 160], (5, 7)), "down": ([96], (6,))}
IN = {"qkv": 96, "o": 96, "gate_up": 96, "down": 160}


def expected_delta(adapter, layer: int, module_ids, widths, x: torch.Tensor) -> torch.Tensor:
    """x @ A.T @ B.T of every slice, from the converted rows (a fused qkv row split by output rows)."""
    out = torch.zeros(x.shape[0], sum(widths), dtype=torch.float64)
    starts = dict(zip(module_ids, [sum(widths[:i]) for i in range(len(widths))]))
    for row in adapter.rows():
        if row.layer_idx != layer:
            continue
        parts = zip((1, 2, 3), row.b.split([SPEC.q_size, SPEC.kv_size, SPEC.kv_size])) if row.module_id == 0 \
            else [(row.module_id, row.b)]
        for mid, b in parts:
            if mid in starts:
                c0 = starts[mid]
                out[:, c0: c0 + b.shape[0]] += x.double() @ row.a.double().T @ b.double().T
    return out


@pytest.mark.parametrize("kind,device,dtype,tol", [
    ("torch", "cpu", torch.float32, 1e-5),
    ("kernels", "cpu", torch.float32, 1e-5),
    pytest.param("kernels", "cuda", torch.float32, 5e-3, marks=pytest.mark.gpu),
    pytest.param("kernels", "cuda", torch.bfloat16, 3e-2, marks=pytest.mark.gpu),
    pytest.param("torch", "cuda", torch.bfloat16, 3e-2, marks=pytest.mark.gpu),
])
@pytest.mark.parametrize("layout", ["scattered", "runs"])
def test_backend_equals_adapter_rows(kind, device, dtype, tol, layout):
    gen = torch.Generator().manual_seed(int(torch.seed() % 2**31))
    dev = torch.device(device)
    slots = PagedAdapterSlots(SPEC, 64, dev, dtype)
    slots.allocate(4 << 20, optimal_adapter_size=4)
    backend = lora_backend_for(slots, 64, kind)
    backend.allocate()
    # Mixed ranks and partial module sets; loads interleaved with an eviction so slots and pages get reused.
    specs = [(8, (1, 2, 3, 4, 5, 6, 7)), (64, (1, 3, 6)), (1, (0, 5, 7)), (17, (1, 2, 3, 4, 5, 6, 7))]
    adapters = []
    for i, (rank, mods) in enumerate(specs):
        adapters.append(random_adapter(SPEC, rank, seed=int(torch.randint(0, 10**6, (1,), generator=gen)),
                                       modules=mods, scale=1.0, dtype=dtype))
        slots.load(f"a{i}", adapters[-1])
        if i == 1:
            slots.load("tmp", random_adapter(SPEC, 4, seed=5))
            assert slots.evict("tmp")
    T = 37
    choices = torch.tensor([-1] + [slots.slot_of(f"a{i}") for i in range(4)])
    for _step in range(2):   # a second step: nothing of the first (e.g. its shrink sums) may leak into it
        keys = torch.randint(0, 5, (T,), generator=gen)      # 0 = no adapter, i + 1 = adapters[i]
        if layout == "runs":                                  # the engine's usual batch: runs of one adapter
            keys = keys.sort().values
        step_slots = choices[keys].to(torch.int32)
        backend.prepare(step_slots, backend.groups_of(step_slots.tolist()))  # as the engine prepares a step
        check_step(backend, adapters, keys, T, dev, dtype, tol, gen)


def check_step(backend, adapters, keys, T, dev, dtype, tol, gen) -> None:
    """Every layer and group of one prepared step, in the model's order, against the adapters' rows."""
    for layer in range(SPEC.num_layers):
        for group, (outs, mids) in GROUPS.items():
            x = torch.randn(T, IN[group], generator=gen).to(dtype)
            base = torch.randn(T, sum(outs), generator=gen).to(dtype)
            want = base.double()
            for i, a in enumerate(adapters):
                rows = keys == i + 1
                want[rows] += expected_delta(a, layer, mids, outs, x[rows].float())
            got = base.clone().to(dev)
            backend.apply(layer, group, x.to(dev), list(got.split(outs, dim=1)))
            got = got.cpu().double()
            scale = (want - base.double()).abs().max().item()
            assert scale > 0.1, "adapters must change the output"
            err = (got - want).abs().max().item()
            assert err <= tol * max(1.0, scale), f"layer {layer} {group}: max err {err} (delta scale {scale})"
            untouched = keys == 0
            assert torch.equal(got[untouched], base[untouched].double()), "tokens without adapter changed"


def test_nan_or_misshaped_adapter_refused_naming_the_problem():
    from compute_service.engine.errors import InvalidAdapterError
    slots = PagedAdapterSlots(SPEC, 16, torch.device("cpu"), torch.float32)
    slots.allocate(1 << 20)
    bad = random_adapter(SPEC, 4, seed=3)
    bad.weights[5, 7] = float("nan")
    with pytest.raises(InvalidAdapterError, match="NaN or Inf"):
        slots.load("nan", bad)
    with pytest.raises(InvalidAdapterError, match=r"row 0 .*rank must be in \[1, max_lora_rank=16\]"):
        slots.load("big", random_adapter(SPEC, 32, seed=4))
    assert slots.stats().pages_used == 0 and not slots.resident("nan")


@pytest.mark.parametrize("kind", ["torch", "kernels"])
def test_a_step_launches_only_the_groups_its_adapters_change(kind):
    """groups_of is the union over the step's slots (a fused q/k/v row counts as q/k/v; an evicted slot
    changes nothing); apply leaves a group outside the prepared set untouched and still adds the others."""
    slots = PagedAdapterSlots(SPEC, 64, torch.device("cpu"), torch.float32)
    slots.allocate(4 << 20, optimal_adapter_size=4)
    backend = lora_backend_for(slots, 64, kind)
    backend.allocate()
    mods = {"qv": (1, 3), "fused": (0,), "o_down": (4, 6), "all": (1, 2, 3, 4, 5, 6, 7)}
    adapters = {k: random_adapter(SPEC, 8, seed=i, modules=m, scale=1.0) for i, (k, m) in enumerate(mods.items())}
    for k, a in adapters.items():
        slots.load(k, a)
    s = {k: slots.slot_of(k) for k in mods}
    assert backend.groups_of([-1, -1]) == frozenset()
    assert backend.groups_of([s["qv"], -1]) == {"qkv"}
    assert backend.groups_of([s["fused"]]) == {"qkv"}
    assert backend.groups_of([s["qv"], s["o_down"], s["qv"]]) == {"qkv", "o", "down"}
    assert backend.groups_of([s["all"], -1]) == ALL_GROUPS
    assert slots.evict("o_down")
    assert backend.groups_of([s["o_down"]]) == frozenset()
    slots.load("gate_up", random_adapter(SPEC, 8, seed=9, modules=(5, 7), scale=1.0))
    assert backend.groups_of([slots.slot_of("gate_up")]) == {"gate_up"}

    T = 5
    step_slots = [s["qv"]] * T
    backend.prepare(torch.tensor(step_slots, dtype=torch.int32), backend.groups_of(step_slots))
    gen = torch.Generator().manual_seed(0)
    for group, changed in (("qkv", True), ("o", False), ("gate_up", False)):
        outs, mids = GROUPS[group]
        x = torch.randn(T, IN[group], generator=gen)
        y = torch.randn(T, sum(outs), generator=gen)
        got = y.clone()
        backend.apply(0, group, x, list(got.split(outs, dim=1)))
        want = y.double() + expected_delta(adapters["qv"], 0, mids, outs, x)
        assert torch.allclose(got.double(), want, atol=1e-4), group
        assert (not torch.equal(got, y)) == changed, group

    # The prepared set is what counts: an adapter on every module, prepared for q/k/v alone, adds to q/k/v only.
    step_slots = [s["all"]] * T
    backend.prepare(torch.tensor(step_slots, dtype=torch.int32), frozenset({"qkv"}))
    for group, changed in (("qkv", True), ("o", False), ("down", False)):
        outs, _ = GROUPS[group]
        y = torch.randn(T, sum(outs), generator=gen)
        got = y.clone()
        backend.apply(0, group, torch.randn(T, IN[group], generator=gen), list(got.split(outs, dim=1)))
        assert (not torch.equal(got, y)) == changed, group
