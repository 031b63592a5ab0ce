"""deploy/grafana: the dashboard queries only metrics the services export.

Every `loraplex_*` name in a panel's query (less Prometheus' `_bucket`,
`_count`, `_sum` suffixes) must be in docs/deploy.md's metrics table and
named in the services' code; tests/integration/test_metrics_scrape.py checks
that every metric in that table appears in a real scrape.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "loraplex-dashboard.json"
SOURCES = [*ROOT.glob("gateway/*.py"), *ROOT.glob("compute_service/*.py"), *ROOT.glob("cache_service/*.py"),
           ROOT / "loraplex" / "metrics.py"]


def documented() -> set[str]:
    text = (ROOT / "docs" / "deploy.md").read_text()
    return set(re.findall(r"^\|\s*`(loraplex_\w+)`\s*\|", text, flags=re.MULTILINE))


def queried() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    names = {n for e in exprs for n in re.findall(r"loraplex_\w+", e)}
    return {re.sub(r"_(bucket|count|sum)$", "", n) for n in names}


def in_code(name: str) -> bool:
    """The name as the code spells it (counters register without `_total`; some gauges end in it)."""
    spellings = {f'"{name}"', f'"{name.removesuffix("_total")}"'}
    return any(s in p.read_text() for p in SOURCES for s in spellings)


def test_dashboard_queries_only_documented_metrics():
    names = queried()
    assert len(names) >= 25
    assert names <= documented(), sorted(names - documented())


def test_every_documented_metric_is_in_the_code():
    missing = sorted(n for n in documented() if not in_code(n))
    assert not missing, missing


def test_dashboard_is_importable():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] == "loraplex"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert all(t["refId"] for t in p["targets"])
