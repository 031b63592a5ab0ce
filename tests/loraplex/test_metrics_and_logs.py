"""The shared hot-path histogram reads like prometheus_client's own; JSON log lines carry request ids."""
from __future__ import annotations

import asyncio
import io
import json
import logging
import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from loraplex.logging_setup import REQUEST_ID, JsonFormatter, _TextRequestIds, TEXT_FORMAT
from loraplex.metrics import ITL_BUCKETS, HistogramFamily


def _lines(registry: CollectorRegistry, name: str) -> list[str]:
    return [x for x in generate_latest(registry).decode().splitlines()
            if x.startswith(name) and not x.startswith(name + "_created")]


def test_fast_histogram_exposes_what_prometheus_client_would():
    fast_reg, ref_reg = CollectorRegistry(), CollectorRegistry()
    fast = HistogramFamily("x_seconds", "x", ITL_BUCKETS, ["tier"], registry=fast_reg)
    ref = Histogram("x_seconds", "x", ["tier"], registry=ref_reg, buckets=ITL_BUCKETS)
    rng = random.Random(3)
    for tier in ("gpu", "host"):
        child = fast.child(tier)
        for _ in range(500):
            v = rng.choice([rng.random() * 3, *ITL_BUCKETS])   # bucket bounds themselves: `le` is inclusive
            n = rng.randint(1, 3)
            child.observe(v, n)
            for _ in range(n):
                ref.labels(tier).observe(v)
    fast_lines, ref_lines = _lines(fast_reg, "x_seconds"), _lines(ref_reg, "x_seconds")
    assert len(fast_lines) == len(ref_lines) == 2 * (len(ITL_BUCKETS) + 3)
    for a, b in zip(sorted(fast_lines), sorted(ref_lines)):
        name_a, value_a = a.rsplit(" ", 1)
        name_b, value_b = b.rsplit(" ", 1)
        assert name_a == name_b
        assert abs(float(value_a) - float(value_b)) < 1e-6 * max(1.0, float(value_b))


def _format(formatter: logging.Formatter, **extra: str) -> str:
    record = logging.LogRecord("gateway.servicer", logging.INFO, __file__, 1, "generate %s", ("x",), None)
    for k, v in extra.items():
        setattr(record, k, v)
    return formatter.format(record)


def test_json_lines_carry_the_request_id_of_the_task_that_logs():
    fmt = JsonFormatter("gateway")
    plain = json.loads(_format(fmt))
    assert plain["message"] == "generate x" and plain["level"] == "INFO" and plain["service"] == "gateway"
    assert "request_id" not in plain and plain["ts"].endswith("Z")
    assert json.loads(_format(fmt, request_id="r-1"))["request_id"] == "r-1"

    async def request(rid: str) -> str:
        REQUEST_ID.set(rid)
        await asyncio.sleep(0)
        return json.loads(_format(fmt))["request_id"]

    async def main() -> list[str]:
        return await asyncio.gather(request("a"), request("b"))
    assert asyncio.run(main()) == ["a", "b"]
    assert "request_id" not in json.loads(_format(fmt))     # the tasks' ids stayed in the tasks


def test_text_lines_show_the_request_id_and_exceptions_stay_readable():
    assert "gateway.servicer [r-2]: generate x" in _format(_TextRequestIds(TEXT_FORMAT), request_id="r-2")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("loraplex-test-json")
    log.addHandler(handler)
    log.propagate = False
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed", extra={"request_id": "r-3"})
    line = json.loads(stream.getvalue())
    assert line["request_id"] == "r-3" and "ValueError: boom" in line["exc_info"]
