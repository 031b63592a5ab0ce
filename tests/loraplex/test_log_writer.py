"""Service log lines are written by a thread of their own: a full stderr pipe does not stop the logging
thread (an event loop logging a line per request), and every line is still written, with the request
id of the thread that logged it, by the time the process exits."""
from __future__ import annotations

import selectors
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import logging, sys
    from loraplex.logging_setup import REQUEST_ID, configure_logging
    configure_logging("INFO", "text", "test")
    log = logging.getLogger("child")
    REQUEST_ID.set("req-7")
    for i in range(3000):                      # ~300 KB: several times a pipe's buffer
        log.info("line %d %s", i, "x" * 40)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    print("logged", flush=True)                # reached only if no log call waited for the reader
    sys.stdin.readline()                       # the parent reads stderr only after this line
""")


def test_logging_does_not_wait_for_a_full_stderr_pipe_and_loses_nothing():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=30), "the child's logging blocked on its unread stderr pipe"
        assert proc.stdout.readline().strip() == "logged"
        proc.stdin.write("\n")
        proc.stdin.flush()
        _out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    lines = err.splitlines()
    logged = [ln for ln in lines if " child [req-7]: line " in ln]
    assert len(logged) == 3000
    assert [int(ln.split(" line ")[1].split()[0]) for ln in logged] == list(range(3000))   # in order
    assert any("child [req-7]: failed" in ln for ln in lines)
    assert "ValueError: boom" in err
