"""Starting loraplex services as child processes and waiting until they listen.

Used by `loraplex serve` and by the integration tests: a service prints
`<name> listening on HOST:PORT` once it serves (see `loraplex.serving`), so a
parent can start it on port 0 and learn the real address.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

_LISTEN_RE = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class ServiceProcess:
    """A running service: its process, address and captured output."""

    name: str
    proc: subprocess.Popen
    address: str = ""
    lines: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, wait, SIGKILL if it does not stop; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_service(name: str, args: list[str], *, timeout_s: float = 120.0,
                  env: dict[str, str] | None = None, echo: bool = False) -> ServiceProcess:
    """Runs `python -m loraplex.cli.main <args>` and waits for its listening line.

    Raises RuntimeError with the process output if it exits or times out first.
    """
    cmd = [sys.executable, "-u", "-m", "loraplex.cli.main", *args]
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, bufsize=1)
    svc = ServiceProcess(name, proc)
    found = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            svc.lines.append(line)
            if echo:
                sys.stderr.write(f"[{name}] {line}")
            m = _LISTEN_RE.search(line)
            if m and not found.is_set():
                svc.address = f"{m.group(1)}:{m.group(2)}"
                found.set()
        found.set()

    threading.Thread(target=pump, name=f"{name}-output", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not found.wait(0.1):
        if time.monotonic() > deadline:
            svc.stop()
            raise RuntimeError(f"{name} did not start within {timeout_s:.0f}s:\n{svc.output()}")
    if not svc.address:
        proc.wait(5)
        raise RuntimeError(f"{name} exited with {proc.returncode} before listening:\n{svc.output()}")
    return svc
