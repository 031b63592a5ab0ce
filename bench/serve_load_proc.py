"""`loraplex serve` as a child process of bench/serve_load.py, as a user would start it.

The gateway's address is chosen here (a free local port), and the system
counts as up once serve prints its own line `gateway listening on HOST:PORT`
(printed after every service answered its health check; the services' own
forwarded log lines start with `[name]`, so they never match). Its output is
kept (the tail is shown when something fails); stopping is SIGTERM, as Ctrl-C
would be, with a kill after a grace period.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """`python -m loraplex.cli.main serve --listen 127.0.0.1:<free port> <flags>`; the HTTP API on a free port
    too unless the flags name one (serve's default, 8000, would clash with another run on the host)."""

    def __init__(self, flags: list[str], timeout_s: float) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        if not any(f == "--http-listen" or f.startswith("--http-listen=") for f in flags):
            flags = ["--http-listen", "127.0.0.1:0", *flags]
        self.lines: deque[str] = deque(maxlen=400)
        self.startup_lines: list[str] = []      # every line up to the ready line (the services' start-up logs)
        ready_line = f"gateway listening on {self.address}"
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli.main", "serve", "--listen", self.address,
                                      *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=ROOT, bufsize=1)
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if not ready.is_set():
                    self.startup_lines.append(line)
                if line.startswith(ready_line):
                    ready.set()
            ready.set()

        threading.Thread(target=pump, name="serve-output", daemon=True).start()
        if not ready.wait(timeout_s) or self.proc.poll() is not None:
            code = self.stop(10)
            raise RuntimeError(f"loraplex serve did not come up within {timeout_s:.0f}s (exit code {code}):\n"
                               + self.tail())
        self.start_s = time.monotonic() - t0

    def tail(self, n: int = 60) -> str:
        return "".join(list(self.lines)[-n:])

    def stop(self, grace_s: float = 60.0) -> int:
        from loraplex.procs import ServiceProcess

        return int(ServiceProcess("serve", self.proc, self.address).stop(grace_s))
