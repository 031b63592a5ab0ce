"""`loraplex quantize` writes folders the engine loads back kept quantized; `--quantization` reaches the
compute service from `loraplex compute` (flag and LORAPLEX_QUANTIZATION) and from `loraplex serve`."""
from __future__ import annotations

import json

import pytest

from compute_service.config import ComputeConfig
from compute_service.engine import load_model
from compute_service.engine.model import LAYER_PROJECTIONS
from compute_service.engine.quant_linear import QuantLinear
from loraplex.cli import main as cli
from loraplex.settings import SettingsError, settings_from_args
from quant_helpers import write_tiny_gguf


def test_quantize_writes_an_awq_folder_with_a_progress_bar(tiny_models, tmp_path, capsys):
    _, src = tiny_models["llama"]
    out = tmp_path / "awq"
    assert cli.main(["quantize", str(src), str(out), "--format", "awq", "--group-size", "16"]) == 0
    captured = capsys.readouterr()
    assert "quantize 4-bit awq" in captured.err and "14/14" in captured.err          # tqdm's bar
    assert f"wrote awq 4-bit group 16 {out}: 14 projections quantized" in captured.out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True,
                                          "version": "gemm", "modules_to_not_convert": None}
    assert (out / "generation_config.json").is_file()
    loaded = load_model(out, quantization="keep")
    assert isinstance(loaded.model.weights.layers[1].down, QuantLinear)


def test_quantize_writes_a_gptq_folder_in_the_models_channel_order(tiny_models, tmp_path, capsys):
    _, src = tiny_models["llama"]
    out = tmp_path / "gptq"
    assert cli.main(["quantize", str(src), str(out), "--format", "gptq", "--group-size", "32", "--quiet"]) == 0
    assert f"wrote gptq 4-bit group 32 {out}: 12 projections quantized" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False,
                   "checkpoint_format": "gptq", "dynamic": {r"-:model\.layers\.0\.mlp\.down_proj$": {},
                                                            r"-:model\.layers\.1\.mlp\.down_proj$": {}}}
    loaded = load_model(out, quantization="keep")
    assert isinstance(loaded.model.weights.layers[1].gate_up, QuantLinear)
    assert loaded.model.weights.layers[1].gate_up.qweight.perm is None
    assert not isinstance(loaded.model.weights.layers[1].down, QuantLinear)      # 32 does not divide 80


def test_the_commands_formats_are_the_writers():
    """`loraplex quantize` lists its formats without importing the writer (torch); the two lists agree."""
    from compute_service.engine.quant_formats import export
    from loraplex.cli import quantize

    assert quantize.FORMATS == export.FORMATS


def test_quantize_errors_are_clear(tiny_models, tmp_path, capsys):
    _, src = tiny_models["llama"]
    assert cli.main(["quantize", str(src), str(tmp_path / "a"), "--format", "awq", "--bits", "8", "--quiet"]) == 1
    assert "AWQ format holds 4-bit weights only" in capsys.readouterr().err
    assert cli.main(["quantize", str(tmp_path / "nope"), str(tmp_path / "b"), "--quiet"]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert cli.main(["quantize", str(src), str(tmp_path / "full"), "--quiet"]) == 1
    assert "not empty" in capsys.readouterr().err
    assert cli.main(["quantize", str(src), str(tmp_path / "c"), "--group-size", "0"]) == 2
    assert cli.main(["quantize", str(src), str(tmp_path / "d"), "--device", "tpu9", "--quiet"]) == 1
    assert "loraplex quantize: " in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_quantize_out_of_device_memory_says_how_to_go_on(tiny_models, tmp_path, capsys, monkeypatch):
    import torch

    from compute_service.engine.quant_formats import export

    def full(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 224.00 MiB")

    monkeypatch.setattr(export, "quantize_checkpoint", full)
    _, src = tiny_models["llama"]
    assert cli.main(["quantize", str(src), str(tmp_path / "o"), "--device", "cpu", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "CUDA out of memory" in err and "--device cpu quantizes in host memory instead" in err


@pytest.mark.gpu
def test_quantize_on_the_gpu_writes_what_the_cpu_writes(tiny_models, tmp_path):
    """`--device cuda` rounds and packs each projection on the GPU: the same tensors as on the CPU."""
    import torch
    from safetensors.torch import load_file

    _, src = tiny_models["llama"]
    for dev in ("cpu", "cuda"):
        assert cli.main(["quantize", str(src), str(tmp_path / dev), "--group-size", "16", "--device", dev,
                         "--quiet"]) == 0
    cpu, gpu = (load_file(str(tmp_path / dev / "model.safetensors")) for dev in ("cpu", "cuda"))
    assert cpu.keys() == gpu.keys() and all(torch.equal(cpu[k], gpu[k]) for k in cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,flags", [("awq", []), ("compressed-tensors", []),
                                       ("compressed-tensors", ["--symmetric", "--bits", "8"]), ("gptq", [])])
def test_gpu_load_unpacks_on_the_gpu_to_what_the_host_unpacks(tiny_models, tmp_path, fmt, flags):
    """On a GPU the readers unpack there (`work_device`): the same codes, scales, offsets and fingerprint as a
    load that unpacks on the host."""
    import torch

    _, src = tiny_models["llama"]
    out = tmp_path / fmt
    assert cli.main(["quantize", str(src), str(out), "--format", fmt, "--group-size", "32", "--quiet", *flags]) == 0
    host, gpu = load_model(out, quantization="keep"), load_model(out, quantization="keep", device="cuda")
    assert host.fingerprint == gpu.fingerprint
    kept = 0
    for a, b in zip(host.model.weights.layers, gpu.model.weights.layers):
        for name in LAYER_PROJECTIONS:
            pa, pb = getattr(a, name), getattr(b, name)
            assert isinstance(pb, QuantLinear) == isinstance(pa, QuantLinear), name
            if not isinstance(pa, QuantLinear):     # kept dense by the writer (the group does not divide K)
                assert torch.equal(pa.weight, pb.weight.cpu()), name
                continue
            kept += 1
            qa, qb = pa.qweight, pb.qweight
            assert all(torch.equal(x, y.cpu()) for x, y in ((qa.q, qb.q), (qa.scales, qb.scales),
                                                            (qa.offsets, qb.offsets))), name
    assert kept >= 6


def test_quantize_reads_gguf_too(tiny_models, tmp_path, capsys):
    model, _ = tiny_models["llama_tied"]
    path = write_tiny_gguf(model, tmp_path / "t.gguf", {"0.mlp.up_proj": "Q8_0"})
    out = tmp_path / "ct8"
    assert cli.main(["quantize", str(path), str(out), "--bits", "8", "--group-size", "16", "--symmetric",
                     "--quiet"]) == 0
    assert "tokenizer: not written" in capsys.readouterr().out       # the tiny GGUF has no vocabulary
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    weights = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["symmetric"], weights["group_size"]) == (8, True, 16)
    kept, source = load_model(out, quantization="keep"), load_model(path)
    assert isinstance(kept.model.weights.layers[0].qkv, QuantLinear)
    assert kept.spec.num_heads == source.spec.num_heads and kept.spec.tie_word_embeddings
    err = (kept.model.weights.layers[0].qkv.dequantize() - source.model.weights.layers[0].qkv.weight).abs().max()
    assert float(err) < 0.01 * float(source.model.weights.layers[0].qkv.weight.abs().max())


def test_quantization_setting_reaches_the_compute_service():
    assert settings_from_args(ComputeConfig, environ={}).quantization == "auto"
    assert settings_from_args(ComputeConfig, environ={"LORAPLEX_QUANTIZATION": "keep"}).quantization == "keep"
    parser = cli.build_parser("compute")
    args = parser.parse_args(["compute", "--quantization", "none"])
    assert settings_from_args(ComputeConfig, args, environ={"LORAPLEX_QUANTIZATION": "keep"}).quantization == "none"
    with pytest.raises(SettingsError, match="quantization"):
        settings_from_args(ComputeConfig, environ={"LORAPLEX_QUANTIZATION": "int4"})
    from loraplex.cli.serve import service_args

    _, compute = service_args(cli.build_parser().parse_args(["serve", "--quantization", "keep"]), "")
    assert compute[compute.index("--quantization") + 1] == "keep"
    _, compute = service_args(cli.build_parser().parse_args(["serve"]), "")
    assert "--quantization" not in compute


def test_describe_projections_reports_what_is_kept_quantized(tiny_models, tmp_path):
    """GetModelInfo's `weights`: kinds and counts of quantized projections, the dense rest, the bytes."""
    from compute_service.engine.quant_formats.summary import describe_projections

    _, src = tiny_models["llama"]
    out = tmp_path / "ct"
    assert cli.main(["quantize", str(src), str(out), "--format", "compressed-tensors", "--group-size", "32",
                     "--quiet"]) == 0
    kept, dense = load_model(out, quantization="keep"), load_model(out, quantization="none")
    text = describe_projections(kept.model.weights, kept.model.dtype)
    assert text.startswith("4-bit group 32: 6 of 8 projections, 2 dense in float32 ("), text
    mib = [float(v) for v in text.split("(")[1].split(" MiB")[0:1]]
    assert 0 < mib[0] < float(text.split("; ")[1].split(" MiB")[0])       # smaller than in float32
    assert describe_projections(dense.model.weights, dense.model.dtype) == "float32"
