"""The shipped Grafana dashboard and Prometheus config against the real proxy: every series a panel
queries is one the proxy exports (a renamed metric fails here, naming the panel, not as an empty
graph mid-run), the quality panels' alarm bounds are the monitor's, and Prometheus scrapes the
address and path the proxy serves /metrics on."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import load_settings
from proxy.config.quality import QualityAlarmConfig
from tests.fakes.episodes import episode_frames, npy_b64
from tests.helpers import REPO
from vlm_protocol.wire import BUDGET_HEADER

DASHBOARD = REPO / "configs" / "grafana" / "vlm-reward-proxy.json"
PROMETHEUS = REPO / "configs" / "prometheus.yml"
FRAMES = npy_b64(episode_frames(6, 64, 64))
# String literals hold label values and regexes, never a metric this dashboard reads: dropped
# before matching, so a matcher's value cannot pass for a metric name.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_METRIC = re.compile(r"(?<![A-Za-z0-9_:])vlm_proxy_[a-z0-9_]+")
# The metric a `label_values(metric, label)` variable reads.
_LABEL_VALUES = re.compile(r"label_values\(\s*(vlm_proxy_[a-z0-9_]+)")


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside a collapsed row too."""
    return [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads, as the exposition spells them (a histogram's
    `_bucket`/`_sum`/`_count`, a counter's `_total`): what Prometheus stores, so what must exist."""
    return set(_METRIC.findall(_STRING.sub('""', expr)))


def _used_by() -> dict[str, set[str]]:
    """Metric name -> the panels (and variables) that read it."""
    dashboard = _dashboard()
    used: dict[str, set[str]] = defaultdict(set)
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            for name in metric_names(target["expr"]):
                used[name].add(f"panel {panel['id']} {panel['title']!r}")
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        for name in _LABEL_VALUES.findall(text):
            used[name].add(f"variable ${variable['name']}")
    return used


def test_metric_names_are_read_from_promql_as_exposed():
    expr = ('histogram_quantile(0.99, sum by (backend, le) (rate(vlm_proxy_request_seconds_bucket'
            '{backend=~"vlm_proxy_not_a_metric"}[$__rate_interval]))) / on(backend) vlm_proxy_in_flight')
    assert metric_names(expr) == {"vlm_proxy_request_seconds_bucket", "vlm_proxy_in_flight"}
    assert metric_names("sum(rate(xvlm_proxy_x[5m]))") == set()


def test_dashboard_is_a_grafana_model_on_one_datasource():
    dashboard = _dashboard()
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"DS_PROMETHEUS", "backend", "run"} <= set(variables)
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    for panel in panels:
        if panel["type"] == "row":
            continue
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} queries nothing"
        for target in [panel, *panel["targets"]]:  # import replaces ${DS_PROMETHEUS} everywhere
            assert target["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]


def test_quality_panels_draw_the_monitors_alarm_bounds():
    bounds = QualityAlarmConfig()  # the defaults a proxy without a `quality:` section alarms at
    wanted = {"vlm_proxy_quality_auc": bounds.min_auc,
              "vlm_proxy_quality_false_success_rate": bounds.max_false_success_rate}
    for metric, bound in wanted.items():
        panels = [p for p in _panels(_dashboard())
                  if any(metric in metric_names(t["expr"]) for t in p.get("targets", []))]
        assert panels, f"no panel reads {metric}"
        for panel in panels:
            steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
            assert bound in [s["value"] for s in steps], f"{panel['title']!r}: thresholds {steps}, alarm at {bound}"
            assert panel["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] != "off"


def _score(client, *, backend: str | None = None, env_success: bool | None = None,
           headers: dict[str, str] | None = None) -> str:
    """The outcome: "ok" or the error code."""
    body: dict[str, Any] = {"task_text": "put the bowl on the plate", "frames_npy": FRAMES}
    if backend is not None:
        body["backend"] = backend
    if env_success is not None:
        body["metadata"] = {"run": "r1", "task_id": 1, "env_success": env_success}
    answer = client.post("/score", json=body, headers=headers or {})
    return "ok" if answer.status_code == 200 else answer.json()["error"]["code"]


def cascade_series(used: dict[str, set[str]]) -> dict[str, set[str]]:
    """The cascades' series (and the stage keys' quality gauges are the quality panels' own): a
    proxy without a cascade exports none, so tests/service/test_cascade.py checks them on its own."""
    return {name: where for name, where in used.items() if name.startswith("vlm_proxy_cascade_")}


def test_every_series_the_dashboard_reads_is_exported(client, fake_qwen):
    # A judged window of failures the default reply (0.75, above the 0.5 threshold) calls successes:
    # the key goes into alarm, so the transitions counter gets a series; a few successes make the
    # AUC and both outcomes' mean scores defined.
    failures = QualityAlarmConfig().min_episodes
    for n in range(failures + 8):
        assert _score(client, env_success=n >= failures) == "ok"
    fake_qwen.script({"reply": "hmm"}, {"reply": "no idea"})  # every parse attempt
    assert _score(client, env_success=False) == "unparseable_score"
    assert _score(client, backend="nope", env_success=True) == "unknown_backend"
    fake_qwen.script({"hang_s": 3600})  # answers nothing while the test runs: the budget ends the wait
    assert _score(client, env_success=False, headers={BUDGET_HEADER: "300"}) == "upstream_timeout"
    scrape = client.get("/metrics")
    assert scrape.status_code == 200
    exported = {s.name for family in text_string_to_metric_families(scrape.text) for s in family.samples}
    used = _used_by()
    assert len(used) >= 20  # the extraction found the dashboard's queries at all
    used = {name: where for name, where in used.items() if name not in cascade_series(used)}
    missing = {name: sorted(where) for name, where in sorted(used.items()) if name not in exported}
    assert not missing, "series the dashboard reads but the proxy does not export:\n" + "\n".join(
        f"  {name}: {', '.join(where)}" for name, where in missing.items())


def test_prometheus_scrapes_the_proxy_where_libero_config_serves_it(client):
    config = yaml.safe_load(PROMETHEUS.read_text())
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "vlm-reward-proxy"]
    proxy = load_settings(REPO / "configs" / "libero.yaml").proxy
    assert [t for c in job["static_configs"] for t in c["targets"]] == [f"{proxy.host}:{proxy.port}"]
    # Without a scoring key /metrics is open; with one, the job must send it.
    assert proxy.api_key_env is None or "authorization" in job
    scrape = client.get(job.get("metrics_path", "/metrics"))  # Prometheus's default path when unset
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    assert "vlm_proxy_requests_total" in scrape.text

