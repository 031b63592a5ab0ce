"""Programmatic dependent launch: when it is on, and that a chain of dependent launches under it computes
exactly what the same chain computes with plain launches (a kernel that read its predecessor's output
before waiting for it would read the previous replay's values instead)."""
import pytest
import torch

from kernels.pdl import ENV, launch_args, pdl_enabled


def test_off_on_the_cpu_and_when_asked(monkeypatch):
    assert not pdl_enabled(torch.device("cpu"))
    assert launch_args(False) == {"USE_PDL": False}
    assert launch_args(True) == {"USE_PDL": True, "launch_pdl": True}
    if torch.cuda.is_available():
        monkeypatch.setenv(ENV, "0")
        assert not pdl_enabled(torch.device("cuda"))


def test_driver_version_bound(monkeypatch):
    from kernels import pdl
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12020, raising=False)
    assert not pdl.driver_supports()
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12080, raising=False)
    assert pdl.driver_supports()
    monkeypatch.delattr(torch._C, "_cuda_getDriverVersion", raising=False)
    assert pdl.driver_supports()


def _chain(x, w_gate_up, w_down, norm_w, normed, gate_up, act, out):
    """One MLP-like link per round: norm -> one-row matmul -> SwiGLU -> one-row matmul, each the next's input."""
    from kernels.dense_gemv import dense_gemv
    from kernels.rms_norm import add_rms_norm
    from kernels.silu_mul import silu_mul

    h = x
    for _ in range(6):
        add_rms_norm(h, None, norm_w, 1e-5, normed)
        dense_gemv(normed, w_gate_up, None, gate_up)
        silu_mul(gate_up, act)
        dense_gemv(act, w_down, None, out)
        h = out


def _graph_replays(monkeypatch, chain, x_shape, buf_shapes, replays, dt=torch.bfloat16, after=None):
    """{flag: [replays] stacked last-buffer outputs} of `chain(x, *bufs)` captured in a CUDA graph, with
    dependent launches on ("1") and off ("0"), new x each replay; `after()` runs after each flag's replays."""
    dev = torch.device("cuda")
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(ENV, flag)
        x = torch.empty(*x_shape, device=dev, dtype=dt)
        bufs = tuple(torch.empty(*shape, device=dev, dtype=dt) for shape in buf_shapes)
        x.normal_(generator=torch.Generator(device=dev).manual_seed(5))
        chain(x, *bufs)                                        # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(x, *bufs)
        outs = []
        for seed in range(replays):                            # new inputs each replay
            x.normal_(generator=torch.Generator(device=dev).manual_seed(100 + seed))
            graph.replay()
            outs.append(bufs[-1].clone())
        results[flag] = torch.stack(outs)
        if after is not None:
            after()
    return results


@pytest.mark.gpu
def test_graph_of_dependent_launches_matches_plain_launches(monkeypatch):
    if not pdl_enabled(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs a Hopper or later GPU")
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(3)
    H, inter = 2048, 5632
    w_gate_up = torch.randn(2 * inter, H, device=dev, dtype=dt, generator=gen) * H ** -0.5
    w_down = torch.randn(H, inter, device=dev, dtype=dt, generator=gen) * inter ** -0.5
    norm_w = torch.rand(H, device=dev, dtype=dt, generator=gen) + 0.5
    results = _graph_replays(monkeypatch, lambda x, *bufs: _chain(x, w_gate_up, w_down, norm_w, *bufs), (1, H),
                             ((1, H), (1, 2 * inter), (1, inter), (1, H)), 20)
    assert torch.isfinite(results["0"]).all()
    assert torch.equal(results["1"], results["0"])


def _packed(n, k, gen, dev):
    from kernels.quant_pack import pack_quantized

    q = torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8, generator=gen)
    s = (torch.rand(n, k // 128, device=dev, generator=gen) * 0.02 + 0.01).half()
    o = (-8 * s.float()).half()
    return pack_quantized(q, s, o, 4, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_quantized_chain_as_dependent_launches_matches_plain(monkeypatch, rows):
    """norm -> 4-bit matmul (split-K) -> SwiGLU -> 4-bit matmul, six rounds, in a graph: dependent launches
    equal plain ones bit for bit (one row: the one-row kernel; eight: the pair-codes tensor-core kernel)."""
    if not pdl_enabled(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs a Hopper or later GPU")
    from kernels.quant_matmul import pick_config, quant_matmul
    from kernels.rms_norm import add_rms_norm
    from kernels.silu_mul import silu_mul

    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(4)
    H, inter = 2048, 5632
    w_gu, w_down = _packed(2 * inter, H, gen, dev), _packed(H, inter, gen, dev)
    norm_w = torch.rand(H, device=dev, dtype=dt, generator=gen) + 0.5
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cfg_gu, cfg_down = pick_config(rows, 2 * inter, H, 4, sms), pick_config(rows, H, inter, 4, sms)
    assert cfg_down.split_k > 1                                 # the locks and partials are in the chain
    work = [(torch.zeros(16 * rows * 2 * inter, device=dev), torch.zeros(4096, dtype=torch.int32, device=dev))
            for _ in range(2)]

    def chain(x, normed, gate_up, act, out):
        h = x
        for _ in range(6):
            add_rms_norm(h, None, norm_w, 1e-5, normed)
            quant_matmul(normed, w_gu, None, gate_up, cfg_gu, *work[0])
            silu_mul(gate_up, act)
            quant_matmul(act, w_down, None, out, cfg_down, *work[1])
            h = out

    results = _graph_replays(monkeypatch, chain, (rows, H), ((rows, H), (rows, 2 * inter), (rows, inter), (rows, H)), 12)
    assert torch.isfinite(results["0"]).all() and results["0"].abs().max() > 0
    assert torch.equal(results["1"], results["0"])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "quant"])
def test_lora_first_chain_as_dependent_launches_matches_plain(monkeypatch, kind):
    """norm -> fused LoRA into float32 zeros -> one-row base kernel that adds it, six rounds, in a graph: the
    base kernel reads x and its weight before waiting for the LoRA launch (LlamaModel._project's order for
    one-token steps). Dependent launches equal plain ones bit for bit, and the delta is left zero."""
    if not pdl_enabled(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs a Hopper or later GPU")
    from kernels.dense_gemv import dense_gemv
    from kernels.fused import fused_workspace, lora_fused_triton
    from kernels.quant_matmul import pick_config, quant_matmul
    from kernels.rms_norm import add_rms_norm
    from lora_case import build_case, prepare_meta

    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(6)
    H, N = 2048, 5632
    case = build_case(ranks={0: [16]}, h_in=H, outs=[N], num_layers=1, dtype=dt, device="cuda",
                      gen=torch.Generator().manual_seed(2))
    meta = prepare_meta(torch.tensor([0], dtype=torch.int32), case.tables.max_slots, device="cuda")
    ws = fused_workspace(4, case.tables.max_rank, dev)
    w_dense = torch.randn(N, H, device=dev, dtype=dt, generator=gen) * H ** -0.5
    w_quant = _packed(N, H, gen, dev)
    w_back = torch.randn(H, N, device=dev, dtype=dt, generator=gen) * N ** -0.5
    norm_w = torch.rand(H, device=dev, dtype=dt, generator=gen) + 0.5
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cfg = pick_config(1, N, H, 4, sms)
    work = (torch.zeros(16 * N, device=dev), torch.zeros(4096, dtype=torch.int32, device=dev))
    delta = torch.zeros(1, N, device=dev)

    def chain(x, normed, y, out):
        h = x
        for _ in range(6):
            add_rms_norm(h, None, norm_w, 1e-5, normed)
            # One K split: the rank-r sums are not summed by atomics in a varying order, so the chain is
            # deterministic and the two launch modes compare bit for bit.
            lora_fused_triton(normed, case.pool, case.tables, meta, 0, [0], delta, [0, N], ws,
                              config={"SPLIT_K": 1})
            if kind == "dense":
                dense_gemv(normed, w_dense, None, y, addend=delta)
            else:
                quant_matmul(normed, w_quant, None, y, cfg, *work, addend=delta)
            dense_gemv(y, w_back, None, out)
            h = out

    def delta_left_zero():
        assert not delta.any(), "the delta must be left all zeros"

    results = _graph_replays(monkeypatch, chain, (1, H), ((1, H), (1, N), (1, H)), 12, after=delta_left_zero)
    assert torch.isfinite(results["0"]).all()
    assert torch.equal(results["1"], results["0"])
    assert not ws[0].any() and not ws[1].any(), "the fused workspace must be left all zeros"
