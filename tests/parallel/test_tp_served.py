"""`loraplex compute --tensor-parallel-size 2` on CPU, as real processes with a host cache: a base and
an adapter request stream the same tokens as the single-process engine; stopping ends every rank."""
from __future__ import annotations

import pytest

from tp_served import serve_tp2_and_generate

pytestmark = pytest.mark.slow


def test_served_tp2_streams_the_single_process_tokens(tmp_path):
    got, want, codes, output = serve_tp2_and_generate(tmp_path, "cpu")
    assert got == {"base": want[0], "lora": want[1]}, output
    assert want[0] != want[1]
    assert codes == [0, 0], output
    assert "tensor parallel group of 2 ranks" in output


def test_serve_passes_tensor_parallel_size_to_compute():
    from loraplex.cli.main import build_parser
    from loraplex.cli.serve import service_args

    args = build_parser().parse_args(["serve", "--device", "cpu", "--tensor-parallel-size", "2"])
    _cache, compute = service_args(args, "")
    assert compute[compute.index("--tensor-parallel-size") + 1] == "2"
    _cache, compute = service_args(build_parser().parse_args(["serve"]), "")
    assert "--tensor-parallel-size" not in compute
