"""docs/grafana/pdserve.json imports into Grafana: valid JSON in its dashboard model, and every
query names only metrics the server exports, through variables the dashboard defines."""
import json
import os
import re

from pdserve.server.metrics import ServerMetrics

DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "grafana", "pdserve.json")
SUFFIXES = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}


def exported_series() -> set[str]:
    """The sample names /metrics carries (a labelled counter's too, before it has any sample)."""
    return {f"{family.name}{suffix}" for family in ServerMetrics().registry.collect()
            for suffix in SUFFIXES[family.type]}


def load() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def queries(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def balanced(expr: str) -> bool:
    stack, pairs = [], {")": "(", "]": "[", "}": "{"}
    for ch in re.sub(r'"[^"]*"', '""', expr):   # brackets inside label values do not count
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def test_the_dashboard_is_a_grafana_dashboard():
    d = load()
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in d["templating"]["list"]}
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    for title, expr in queries(d):
        assert balanced(expr), (title, expr)
        for name in re.findall(r"\$(\w+)", expr):
            assert name in variables | {"__rate_interval"}, (title, name)


def test_every_query_names_metrics_the_server_exports():
    exported = exported_series()
    assert "pdserve:time_to_first_token_seconds_bucket" in exported and "pdserve:num_preemptions_total" in exported
    used = set()
    for title, expr in queries(load()):
        names = re.findall(r"pdserve:[A-Za-z0-9_:]+", expr)
        assert names, (title, expr)
        for name in names:
            assert name in exported, f"panel {title!r} queries {name}, which the server does not export"
        used.update(names)
    # the panels: TTFT, TPOT and ITL histograms, the queue, KV usage, preemptions
    for name in ("time_to_first_token_seconds_bucket", "request_time_per_output_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total"):
        assert f"pdserve:{name}" in used, name


def test_queries_work_with_or_without_the_model_name_label():
    # every selector filters by the variables, and the variables' "All" matches an absent label
    for title, expr in queries(load()):
        for selector in re.findall(r"pdserve:[A-Za-z0-9_:]+(\{[^}]*\}|)", expr):
            assert 'model_name=~"$model_name"' in selector, (title, expr)
    model = next(v for v in load()["templating"]["list"] if v["name"] == "model_name")
    assert model["includeAll"] and re.fullmatch(model["allValue"], "")
