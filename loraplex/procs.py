"""Starting loraplex services as child processes and waiting until they listen.

Used by `loraplex serve` and by the integration tests: a service prints
`<name> listening on HOST:PORT` once it serves (see `loraplex.serving`), so a
parent can start it on port 0 and learn the real address.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

# At the start of a line: `loraplex serve` also forwards its services' lines, prefixed "[name] ".
_LISTEN_RE = re.compile(r"^\S+ listening on (\S+):(\d+)")


@dataclass
class ServiceProcess:
    """A running service: its process, address and captured output."""

    name: str
    proc: subprocess.Popen
    address: str = ""
    lines: list[str] = field(default_factory=list)
    listening: threading.Event = field(default_factory=threading.Event)   # set at the listening line or exit

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


def spawn_service(name: str, args: list[str], *, env: dict[str, str] | None = None,
                  echo: bool = False) -> ServiceProcess:
    """Starts `python -m loraplex.cli.main <args>` and returns at once; `wait_listening` learns its address."""
    cmd = [sys.executable, "-u", "-m", "loraplex.cli.main", *args]
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, bufsize=1)
    svc = ServiceProcess(name, proc)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            svc.lines.append(line)
            if echo:
                sys.stderr.write(f"[{name}] {line}")
            m = _LISTEN_RE.search(line)
            if m and not svc.listening.is_set():
                svc.address = f"{m.group(1)}:{m.group(2)}"
                svc.listening.set()
        svc.listening.set()

    threading.Thread(target=pump, name=f"{name}-output", daemon=True).start()
    return svc


def wait_listening(svc: ServiceProcess, timeout_s: float) -> ServiceProcess:
    """Blocks until the service printed its listening line; RuntimeError (with its output) if it exits or
    times out first."""
    deadline = time.monotonic() + timeout_s
    while not svc.listening.wait(0.1):
        if time.monotonic() > deadline:
            svc.stop()
            raise RuntimeError(f"{svc.name} did not start within {timeout_s:.0f}s:\n{svc.output()}")
    if not svc.address:
        svc.proc.wait(5)
        raise RuntimeError(f"{svc.name} exited with {svc.proc.returncode} before listening:\n{svc.output()}")
    return svc


def start_service(name: str, args: list[str], *, timeout_s: float = 120.0,
                  env: dict[str, str] | None = None, echo: bool = False, healthy: bool = True) -> ServiceProcess:
    """Runs `python -m loraplex.cli.main <args>`, waits for its listening line and (with `healthy`) until its
    health check says SERVING: the compute service listens while it warms up, NOT_SERVING until ready.

    Raises RuntimeError with the process output if it exits or times out first.
    """
    deadline = time.monotonic() + timeout_s
    svc = wait_listening(spawn_service(name, args, env=env, echo=echo), timeout_s)
    if healthy:
        wait_serving(svc, deadline)
    return svc


def wait_serving(svc: ServiceProcess, deadline: float) -> None:
    """Polls the service's health until SERVING; RuntimeError if it exits or `deadline` (monotonic) passes."""
    from loraplex.serving import wait_healthy

    while True:
        try:
            asyncio.run(wait_healthy(svc.address, timeout_s=max(0.5, min(5.0, deadline - time.monotonic()))))
            return
        except TimeoutError:
            if svc.proc.poll() is not None:
                raise RuntimeError(f"{svc.name} exited with {svc.proc.returncode} before it was healthy:\n"
                                   f"{svc.output()}") from None
            if time.monotonic() > deadline:
                svc.stop()
                raise RuntimeError(f"{svc.name} not healthy in time:\n{svc.output()}") from None
