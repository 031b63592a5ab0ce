"""A service's announcement lines (`<name> listening on HOST:PORT`, which `loraplex serve` and the tests
parse) stay whole while the log thread writes to the same pipe: `say` writes text and newline at once."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

from loraplex.logging_setup import say

CHILD = textwrap.dedent("""
    import logging, sys, threading
    from loraplex.logging_setup import configure_logging, say
    configure_logging("INFO", "text", "test")
    log = logging.getLogger("child")
    done = threading.Event()
    def flood():
        while not done.is_set():
            log.info("log line %s", "y" * 30)
    threads = [threading.Thread(target=flood) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(3000):
        {announce}
    done.set()
    for t in threads:
        t.join()
""")


def _announced(announce: str) -> list[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")      # as `loraplex serve` and the tests run services
    out = subprocess.run([sys.executable, "-c", CHILD.format(announce=announce)], env=env, check=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120).stdout
    return [line for line in out.splitlines() if "listening on" in line]


def test_announcement_lines_stay_whole_beside_the_log_thread():
    lines = _announced('say(f"svc listening on 127.0.0.1:{i}")')
    assert lines == [f"svc listening on 127.0.0.1:{i}" for i in range(3000)]


def test_say_writes_the_line_in_one_call():
    class Recording(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def write(self, s: str) -> int:
            self.calls.append(s)
            return super().write(s)

    stream = Recording()
    say("gateway listening on 127.0.0.1:7000", stream)
    assert stream.calls == ["gateway listening on 127.0.0.1:7000\n"]
