"""Processes `loraplex serve` manages besides the services: redis-server, log forwarding, shutdown."""
from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from loraplex.procs import ServiceProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def reserve_shared_port(address: str) -> Iterator[str]:
    """HOST:PORT for processes that will share it (SO_REUSEPORT): port 0 becomes a free port, held by a
    bound socket that never listens (so it takes no connections) until the block ends, when the sharers
    listen on it; a named port is checked to be free for sharing. Yields the address with its port."""
    host, _, port = address.rpartition(":")
    bare = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((bare, int(port)))
        except OSError as exc:
            raise OSError(f"cannot share {address} between gateway processes: {exc.strerror or exc}") from exc
        yield f"{host}:{s.getsockname()[1]}"


@dataclass
class RedisServer:
    """A foreground redis-server on a free local port, no persistence (TOOLCHAIN.md)."""

    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, timeout_s: float = 20.0, port: int = 0) -> "RedisServer":
        """`port` 0: a free one (a restart passes the port it had)."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: `apt-get install redis-server` (make setup "
                               "does), pass --redis-url to use a running one, or use --backend shm")
        port = port or free_port()
        proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                 "--appendonly", "no"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                raise RuntimeError(f"redis-server exited with {proc.returncode}:\n{out}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        threading.Thread(target=_drain, args=(proc,), daemon=True).start()
                        return cls(proc, port)
            except OSError:
                time.sleep(0.1)
        proc.kill()
        raise RuntimeError(f"redis-server did not answer on port {port} within {timeout_s:.0f}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _drain(proc: subprocess.Popen) -> None:
    """Reads redis-server's output so its pipe never fills."""
    assert proc.stdout is not None
    for _ in proc.stdout:
        pass


def forward_logs(services: list[ServiceProcess]) -> None:
    """Copies each service's new output lines to stderr, prefixed, from a daemon thread.

    Lines are taken off `ServiceProcess.lines` as they are printed, so a long-running
    system does not keep its whole log in memory.
    """
    def pump() -> None:
        while True:
            for svc in services:
                n = len(svc.lines)
                if n:
                    batch = svc.lines[:n]
                    del svc.lines[:n]
                    sys.stderr.write("".join(f"[{svc.name}] {line}" for line in batch))
            sys.stderr.flush()
            time.sleep(0.2)

    threading.Thread(target=pump, name="serve-logs", daemon=True).start()


def stop_all(services: list[ServiceProcess], redis: RedisServer | None) -> None:
    """Stops services in reverse start order (gateway first), then redis-server."""
    for svc in reversed(services):
        code = svc.stop()
        print(f"serve: {svc.name} stopped (exit code {code})", file=sys.stderr, flush=True)
    if redis is not None:
        redis.stop()
