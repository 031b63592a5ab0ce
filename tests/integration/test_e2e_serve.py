"""`loraplex serve` as a user runs it: one command, the README's CLI calls, Ctrl-C/SIGTERM stops all.

Uses the redis backend, so serve also starts (and stops) a real redis-server.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import pytest

from loraplex.procs import start_service
from integration.e2e_support import PROMPT_EN, write_peft_adapter

pytestmark = [pytest.mark.serial, pytest.mark.slow, pytest.mark.timeout(900)]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraplex.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_serve_redis_cpu_cli_and_clean_stop(tmp_path):
    root = tmp_path / "root"
    write_peft_adapter(root / "style", seed=5, std=0.1)
    lora = write_peft_adapter(tmp_path / "mine", seed=6, std=0.1)
    svc = start_service("serve", ["serve", "--listen", "127.0.0.1:0", "--device", "cpu", "--backend", "redis",
                                  "--lora-root", str(root), "--max-model-len", "512"], timeout_s=600)
    try:
        url = ["--url", svc.address]
        base = cli("generate", "--text", PROMPT_EN, "--request-output-len", "8", *url)
        assert base.returncode == 0, base.stderr
        assert "Paris" in base.stdout  # SmolLM2 knows
        first = cli("generate", "--text", PROMPT_EN, "-o", "8", "--lora-path", str(lora), "--lora-task-id", "1", *url)
        again = cli("generate", "--text", PROMPT_EN, "-o", "8", "--lora-task-id", "1", "--streaming", *url)
        named = cli("generate", "--text", PROMPT_EN, "-o", "8", "--lora-name", "style", *url)
        assert first.returncode == again.returncode == named.returncode == 0, first.stderr + again.stderr + named.stderr
        assert first.stdout == again.stdout != base.stdout
        assert named.stdout != base.stdout
        fan = cli("generate", "--text", PROMPT_EN, "-o", "8", "--fan-out", "base,1,style", *url)
        assert fan.returncode == 0, fan.stderr
        assert base.stdout in fan.stdout and first.stdout in fan.stdout and named.stdout in fan.stdout
        listing = cli("list", *url)
        assert "task_id=1 " in listing.stdout and "name=style" in listing.stdout
        missing = cli("generate", "--text", "hi", "--lora-task-id", "999", *url)
        assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    finally:
        svc.proc.send_signal(signal.SIGTERM)
        code = svc.proc.wait(60)
    out = svc.output()
    assert code == 0, out
    for name in ("gateway", "compute", "cache"):
        assert f"serve: {name} stopped (exit code 0)" in out
    assert "serve: redis-server at redis://127.0.0.1:" in out and out.rstrip().endswith("serve: stopped")
