"""The client stays light: a name or task id never imports torch; inline tensors do.

Each check runs in a fresh interpreter, so a module-level `import torch` anywhere on
the client's import path (client, client_types, tensor_proto, errors, the stubs)
makes it fail.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_generating_by_name_or_task_id_imports_neither_torch_nor_numpy():
    out = run_python("""
        import sys
        from loraplex.client import AsyncClient, Client, Lora
        from loraplex.client_types import build_generate_request
        from loraplex.cli import generate
        req = build_generate_request("hi", ["jp", 3, None, Lora(name="x", load_mode="never")], max_tokens=4)
        assert [l.name for l in req.loras] == ["jp", "", "", "x"], req
        assert req.loras[1].task_id == 3
        with Client("127.0.0.1:1") as c:       # a channel only; nothing is sent
            pass
        print(sorted(m for m in ("torch", "numpy") if m in sys.modules))
    """)
    assert out.strip() == "[]"


def test_inline_tensors_do_import_torch_and_travel():
    out = run_python("""
        import sys
        import numpy as np
        from loraplex.client_types import Lora
        assert "torch" not in sys.modules
        spec = Lora(task_id=5, weights=np.ones((2, 8), np.float16), config=np.zeros((2, 3), np.int32)).to_proto()
        print("torch" in sys.modules, list(spec.weights.shape), len(spec.weights.data))
    """)
    assert out.split() == ["True", "[2,", "8]", "32"]


def test_the_generate_command_by_name_imports_no_torch():
    out = run_python("""
        import sys
        from loraplex.cli.main import main
        assert main(["generate", "--text", "hi", "--lora-name", "jp", "--dump-json"]) == 0
        print("torch" in sys.modules)
    """)
    assert out.strip().splitlines()[-1] == "False"
    assert '"name": "jp"' in out
