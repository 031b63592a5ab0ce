"""Log lines as text (default) or as one JSON object per line (`--log-format json`), with request ids.

A JSON line has `ts` (UTC, ISO 8601 with milliseconds), `level`, `logger`,
`message`, `service`, and `request_id` when the line belongs to a request:
from the record's `extra={"request_id": ...}`, else from `REQUEST_ID` (a
context variable the gateway sets while it serves a Generate call, so every
line logged for that call, in any task it starts, carries the id). The
gateway passes its id to compute in `GenerateTokensRequest.request_id`, so the
compute service's lines about a request carry the same id (with a `/N` suffix
for the N-th entry of a fan-out). Exceptions go in `exc_info` as text.

Lines are formatted where they are logged (the request id is the caller's)
and written to stderr by a thread of their own: a service's event loop logs a
line per request, and the write (to a pipe that `loraplex serve` relays, which
blocks while the pipe is full) no longer runs on it. Lines still queued at
exit are written before the process ends.
"""
from __future__ import annotations

import atexit
import contextvars
import json
import logging
import queue
import sys
import time
from logging.handlers import QueueHandler, QueueListener

LOG_FORMATS = ("text", "json")
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("loraplex_request_id", default="")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def __init__(self, service: str = "") -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out = {"ts": ts, "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if self.service:
            out["service"] = self.service
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        if rid:
            out["request_id"] = rid
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class _TextRequestIds(logging.Formatter):
    """The text format, with ` [request_id]` after the logger name when the line has one."""

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        saved = record.name
        if rid:
            record.name = f"{saved} [{rid}]"
        try:
            return super().format(record)
        finally:
            record.name = saved


def configure_logging(level: str = "INFO", log_format: str = "text", service: str = "") -> None:
    """Logs to stderr at `level`, as text or JSON lines (a no-op when logging is configured already)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format: expected text or json, got {log_format!r}")
    if logging.getLogger().handlers:
        return
    lines: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    handler = QueueHandler(lines)       # formats in the logging thread; the writer only writes the text
    handler.setFormatter(JsonFormatter(service) if log_format == "json" else _TextRequestIds(TEXT_FORMAT))
    writer = QueueListener(lines, logging.StreamHandler(sys.stderr))
    writer.start()
    atexit.register(writer.stop)
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])


def say(text: str, stream=None) -> None:
    """Writes `text` and its newline in one write, then flushes (stdout unless `stream` is given).

    A service's stdout and stderr share one pipe under `loraplex serve` and the tests; `print` writes the
    text and the newline separately, and a log line written by the log thread between the two lands in the
    middle of the line (`... listening on 127.0.0.1:354612026-11-25 19:59:55,749 INFO ...`), which then
    names a port that does not exist."""
    out = sys.stdout if stream is None else stream
    out.write(text + "\n")
    out.flush()
