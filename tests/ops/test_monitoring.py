"""Monitoring: /metrics/platform and /metrics/engines read from the database and Redis, the alert
rules pass their promtool unit tests (deploy/prometheus/alerts_test.yml), and every metric the
rules and the Grafana dashboard name is one the platform (or its vLLM engines) exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import uuid
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from accounts.services import api_key_create, organization_create
from billing.models import Reconciliation, UsageRollup
from core.redis import sync_redis
from registry.models import Deployment, Model, ModelVersion, Replica
from registry.services import deployment_create
from tests.support.batches import batch

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "inference-platform.json"


def scrape(client, path: str = "/metrics/platform") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get(path)
    assert response.status_code == 200, response.content
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    }


def deploy(name: str, *, replicas: int) -> Deployment:
    model = Model.objects.create(name=name, task="chat")
    version = ModelVersion.objects.create(
        model=model, version="1", framework="fake", artifact_uri=f"local://{name}/1", artifact_sha256="0" * 64,
        artifact_size=1, config={"max_seq_len": 512},
    )  # fmt: skip
    return deployment_create(version=version, replicas=replicas, max_replicas=max(2, replicas))


@pytest.mark.django_db
class TestPlatformMetrics:
    def test_replicas_budgets_reconciliation_and_batches_are_read_when_scraped(self, client, monkeypatch, settings):
        settings.REPLICA_STALE_AFTER = 600  # a loaded machine may take seconds between the rows and the scrape
        tag = uuid.uuid4().hex[:6]
        deployment = deploy(f"watched-{tag}", replicas=3)
        now = timezone.now()
        Replica.objects.create(
            deployment=deployment, host="h", state="ready", last_heartbeat=now, endpoint="http://10.0.0.5:8001"
        )
        Replica.objects.create(
            deployment=deployment, host="h", state="ready", last_heartbeat=now - timedelta(hours=1)
        )  # stale
        Replica.objects.create(deployment=deployment, host="h", state="ready", last_heartbeat=now, standby=True)
        Replica.objects.create(deployment=deployment, host="h", state="failed")

        org = organization_create(name=f"Watched {tag}")
        org.monthly_spend_cap = Decimal("20")
        org.monthly_token_quota = 1000
        org.save()
        key = api_key_create(organization=org, name="k").api_key
        UsageRollup.objects.create(
            period=UsageRollup.Period.DAY, start=now.replace(hour=0, minute=0, second=0, microsecond=0),
            organization=org, api_key=key, model="m", model_version="1", requests=3, input_tokens=100,
            output_tokens=150, cost=Decimal("5"),
        )  # fmt: skip
        Reconciliation.objects.create(
            period_start=now + timedelta(days=3650), period_end=now + timedelta(days=3650, hours=1), stream_events=10,
            records=9, rollup_requests=9, records_cost=Decimal("1"), rollup_cost=Decimal("1"), ok=False,
        )  # fmt: skip
        waiting = batch(org, key, lines={"pending": 2, "succeeded": 1})
        type(waiting).objects.filter(pk=waiting.pk).update(created_at=now - timedelta(hours=2))

        stream = f"test-usage-{tag}"
        monkeypatch.setattr("console.monitoring.usage_stream", lambda: stream)
        redis = sync_redis()
        redis.xadd(stream, {"e": "1"}, id=f"{int(time.time() * 1000) - 90_000}-0")  # waiting 90 s
        redis.xadd(stream, {"e": "2"})
        try:
            samples = scrape(client)
        finally:
            redis.delete(stream)

        labels = (("deployment", str(deployment.pk)), ("model", f"watched-{tag}"), ("version", "1"))
        assert samples[("platform_deployment_replicas_wanted", labels)] == 3
        assert samples[("platform_deployment_replicas_ready", labels)] == 1  # not the stale one, nor the standby
        assert samples[("platform_deployment_replicas_failed", labels)] == 1
        assert samples[("platform_usage_stream_length", ())] == 2
        assert 89 < samples[("platform_usage_stream_oldest_age_seconds", ())] < 150
        assert samples[("platform_reconciliation_ok", ())] == 0  # the latest (here: a future hour) disagrees
        assert samples[("platform_reconciliation_delta", (("between", "events_records"),))] == 1
        spend = (("budget", "spend"), ("organization", org.slug))
        tokens = (("budget", "tokens"), ("organization", org.slug))
        assert samples[("platform_organization_budget_used_ratio", spend)] == pytest.approx(0.25)
        assert samples[("platform_organization_budget_used_ratio", tokens)] == pytest.approx(0.25)
        assert samples[("platform_batch_lines_waiting", ())] >= 2
        assert samples[("platform_batch_backlog_age_seconds", ())] >= 2 * 3600 - 5
        budget = (("model", f"watched-{tag}"),)
        assert 0 < samples[("platform_cache_wrong_hit_budget", budget)] < 1
        assert (
            samples[("platform_cache_wrong_hit_rate", (("bound", "upper"), *budget))]
            >= samples[("platform_cache_wrong_hit_rate", (("bound", "estimate"), *budget))]
        )

    def test_engines_are_discovered_for_prometheus(self, client):
        deployment = deploy(f"discovered-{uuid.uuid4().hex[:6]}", replicas=1)
        ready = Replica.objects.create(
            deployment=deployment, host="gpu-7", state="ready", endpoint="http://10.0.0.9:8123"
        )
        Replica.objects.create(deployment=deployment, host="gpu-7", state="stopped", endpoint="http://10.0.0.9:8124")
        groups = client.get("/metrics/engines").json()
        mine = [g for g in groups if g["labels"]["model"] == deployment.version.model.name]
        assert mine == [{"targets": ["10.0.0.9:8123"], "labels": {
            "model": deployment.version.model.name, "version": "1", "replica": str(ready.pk), "host": "gpu-7",
            "standby": "false"}}]  # fmt: skip

    @pytest.mark.parametrize("path", ["/metrics/platform", "/metrics/engines"])
    def test_only_the_monitoring_network_or_the_token_may_scrape(self, client, settings, path):
        assert client.get(path, REMOTE_ADDR="203.0.113.9").status_code == 403
        settings.METRICS_TOKEN = "scrape-secret"
        authorized = client.get(path, REMOTE_ADDR="203.0.113.9", HTTP_AUTHORIZATION="Bearer scrape-secret")
        assert authorized.status_code == 200


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) is not installed")
def test_the_alert_rules_are_valid_and_pass_their_unit_tests():
    checked = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(["promtool", "test", "rules", str(RULE_TESTS)], capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Every rule has a test that fires it.
    fired = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for case in test["alert_rule_test"] if case["exp_alerts"]}  # fmt: skip
    rules = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    assert rules == fired, rules ^ fired


# --- Every name a query uses is exported ------------------------------------------------------

PROMQL_WORDS = {
    "sum", "by", "rate", "histogram_quantile", "on", "group_left", "offset", "deriv", "le", "bool", "and", "or",
    "unless", "without", "max", "min", "avg", "count", "increase", "delta", "ignoring", "group_right",
}  # fmt: skip


def query_names(expr: str) -> set[str]:
    """The metric names an expression reads (label names inside {} and by (...) left out)."""
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(by|on|without|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\b\d+(\.\d+)?[smhdwy]?\b", "", expr)  # numbers and durations (offset 15m)
    return {name for name in re.findall(r"[a-zA-Z_][a-zA-Z0-9_:]*", expr) if name not in PROMQL_WORDS}


def exported_names() -> set[str]:
    """Sample names the gateways' /metrics, /metrics/platform and the vLLM engines can show."""
    from prometheus_client import REGISTRY

    import serving.gateway.metrics  # noqa: F401 (registers the data plane's metrics)

    names = set()
    for family in REGISTRY.collect():
        suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_sum", "_count", "_created"],
                    "gauge": [""]}.get(family.type, [""])  # fmt: skip
        names |= {family.name + suffix for suffix in suffixes}
    source = (ROOT / "console" / "monitoring.py").read_text()
    names |= set(re.findall(r'"(platform_[a-z_]+)"', source))
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None
    assert spec.origin is not None
    loggers = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    for name in re.findall(r'"(vllm:[a-z_]+)"', loggers):
        names |= {name, f"{name}_total", f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def test_every_metric_the_rules_and_the_dashboard_read_is_exported():
    exprs = [rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs += [target["expr"] for panel in panels for target in panel["targets"]]
    assert len(panels) >= 12
    used = set().union(*(query_names(expr) for expr in exprs))
    assert "inference_requests_total" in used
    assert "platform_deployment_replicas_ready" in used
    unknown = used - exported_names()
    assert not unknown, f"queries read metrics nothing exports: {sorted(unknown)}"


def test_the_overview_uses_the_alert_rules_thresholds():
    from console.monitoring import THRESHOLDS

    rules = {
        rule["alert"]: rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    }
    for alert, threshold in THRESHOLDS.items():
        right = rules[alert].rsplit(">", 1)[1].strip()
        assert re.fullmatch(r"[\d.]+( \* [\d.]+)?", right), rules[alert]
        value = 1.0
        for factor in right.split("*"):
            value *= float(factor)
        assert value == threshold, alert


@pytest.mark.django_db
def test_the_overview_lists_what_needs_attention_with_links(admin_client, settings):
    settings.REPLICA_STALE_AFTER = 600  # a loaded machine may take seconds between the rows and the page
    tag = uuid.uuid4().hex[:6]
    deployment = deploy(f"short-{tag}", replicas=2)
    Replica.objects.create(deployment=deployment, host="h", state="ready", last_heartbeat=timezone.now())
    Replica.objects.create(deployment=deployment, host="h", state="failed")
    org = organization_create(name=f"Spender {tag}")
    org.monthly_spend_cap = Decimal("10")
    org.save()
    key = api_key_create(organization=org, name="k").api_key
    UsageRollup.objects.create(
        period=UsageRollup.Period.DAY, start=timezone.now().replace(hour=0, minute=0, second=0, microsecond=0),
        organization=org, api_key=key, model="m", model_version="1", requests=1, cost=Decimal("9.5"),
    )  # fmt: skip
    page = admin_client.get("/console/").content.decode()
    section = page[page.index('id="attention"') : page.index('id="batch-queue"')]
    assert f"short-{tag}:1 has 1 of 2 replicas ready" in section
    assert f"short-{tag}:1: 1 replica failed" in section
    assert f"{org.slug} has used 95% of its monthly spend budget" in section
    assert f'href="/console/customers/{org.pk}/"' in section
    assert 'href="/console/deployments/"' in section


@pytest.mark.django_db
def test_with_redis_away_the_figures_it_holds_are_unknown_not_zero(client, monkeypatch):
    from redis.exceptions import ConnectionError as RedisConnectionError

    from console.monitoring import attention, platform_state

    class Away:
        def pipeline(self, **_: object) -> Away:
            raise RedisConnectionError("refused")

    monkeypatch.setattr("console.monitoring.sync_redis", lambda: Away())
    monkeypatch.setattr("console.monitoring.cache_quality", lambda **_: (_ for _ in ()).throw(RedisConnectionError()))
    state = platform_state()
    assert (state.usage_stream_length, state.usage_oldest_age_seconds, state.cache) == (None, None, [])
    assert "RedisUnreachable" in {item.alert for item in attention(state)}
    names = {name for name, _ in scrape(client)}
    assert "platform_usage_stream_oldest_age_seconds" not in names
    assert "platform_deployment_replicas_wanted" in names or not state.deployments
