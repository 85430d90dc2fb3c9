"""The reference pages say what the code has, read from the code itself: every management command
and its options (docs/reference/cli.md), every metric the platform exports (docs/reference/metrics.md),
every path of the OpenAPI schema (docs/reference/http-api.md and management-api.md); every API path
the reference pages and guides name exists; and every relative link of docs/ and the README points
at a file, and a heading, that exist."""

from __future__ import annotations

import importlib
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from django.conf import settings
from django.core.management import get_commands, load_command_class
from django.core.management.base import BaseCommand
from django.urls import Resolver404, resolve

ROOT = Path(settings.BASE_DIR)
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
# The platform's own apps, whose commands the reference lists (Django's and libraries' are not).
PROJECT_APPS = ("accounts", "billing", "console", "core", "registry", "rollout", "serving")
# What a metric's name carries on the wire beyond its family's: cut from the names the page uses.
EXPORTED_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


# --- markdown -------------------------------------------------------------------------------


def prose(text: str) -> Iterator[str]:
    """The lines of a markdown text outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped but for '-' and '_',
    spaces turned into '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated heading's get -1, -2 … as on GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    for line in prose(text):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = github_slug(match.group(1))
            found.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
            seen[slug] += 1
    return found


def sections(text: str, level: int = 3) -> dict[str, str]:
    """Each heading of ``level`` and the text under it, up to the next heading of that level or above."""
    out: dict[str, str] = {}
    current: str | None = None
    for line in prose(text):
        match = re.match(r"(#{1,6})\s+(.*?)\s*$", line)
        if match and len(match.group(1)) <= level:
            current = match.group(2) if len(match.group(1)) == level else None
            if current is not None:
                out[current] = ""
            continue
        if current is not None:
            out[current] += line + "\n"
    return out


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def broken_links(path: Path) -> list[str]:
    """The relative links of ``path`` whose file, or heading, does not exist."""
    problems = []
    for line in prose(path.read_text()):
        line = re.sub(r"`[^`]*`", "", line)  # code is not a link, and a link's text may hold code
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                problems.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.is_file() and anchor not in anchors(linked.read_text()):
                problems.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    return problems


# --- what the code has ----------------------------------------------------------------------


def project_commands() -> dict[str, str]:
    """Every management command of the platform's apps: its name to its app."""
    found = {name: app for name, app in get_commands().items() if app in PROJECT_APPS}
    on_disk = {
        path.stem: path.parts[-4]
        for app in PROJECT_APPS
        for path in (ROOT / app).glob("management/commands/*.py")
        if not path.stem.startswith("_")
    }
    return {**on_disk, **found}


def command_arguments(app: str, name: str) -> list[str]:
    """The options (``--x``) and positional arguments a command declares in ``add_arguments``,
    without those every Django command has (told apart by their destination too: purge_cache's
    ``--version`` is its own)."""
    common = {
        (option, action.dest)
        for action in BaseCommand().create_parser("manage.py", "command")._actions
        for option in action.option_strings
    }
    parser = load_command_class(app, name).create_parser("manage.py", name)
    names = []
    for action in parser._actions:
        if not action.option_strings:
            names.append(action.dest)
        names += [option for option in action.option_strings if (option, action.dest) not in common]
    return names


def gateway_metric_families() -> set[str]:
    """The metric families the data plane defines with prometheus_client (serving.gateway.metrics,
    and any other module that registers one in the default registry), without the library's own."""
    import prometheus_client

    # Every view (so every module that defines a metric), the metrics module, and runworkers'.
    for module in ("console.urls", "serving.gateway.metrics", "serving.supervisor.host"):
        importlib.import_module(module)
    own = {
        family.name
        for collector in (
            prometheus_client.GC_COLLECTOR,
            prometheus_client.PLATFORM_COLLECTOR,
            prometheus_client.PROCESS_COLLECTOR,
        )
        for family in collector.collect()
    }
    return {family.name for family in prometheus_client.REGISTRY.collect()} - own


def platform_metric_families(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The families console.monitoring.PlatformCollector yields, with a state that has one of
    everything (so that no family is left out for want of a row)."""
    from console import monitoring

    state = monitoring.PlatformState(
        deployments=[monitoring.DeploymentState("m", "1", 1, wanted=2, ready=1, failed=1)],
        usage_stream_length=3,
        usage_oldest_age_seconds=1.5,
        usage_dead_letters=0,
        reconciliation=monitoring.ReconciliationState(True, 0, 0, 0.0, 60.0),
        budgets=[monitoring.BudgetState(1, "acme", "spend", 0.5)],
        batch_lines_waiting=0,
        batch_backlog_age_seconds=0.0,
        cache=[monitoring.CacheState("m", 0.001, 0.004, 0.01)],
    )
    monkeypatch.setattr(monitoring, "platform_state", lambda: state)
    return {family.name for family in monitoring.PlatformCollector().collect()}


def predict_worker_metrics() -> set[str]:
    """The names in the predict worker's /metrics text, from its own ``metrics``."""
    from serving.predict.worker import Worker

    stats = SimpleNamespace(refused=0, timed_out=0, batch_sizes={1: 1})
    worker = SimpleNamespace(running=0, requests=0, batcher=SimpleNamespace(queue_rows=0, stats=stats))
    text = Worker.metrics(worker)
    return {re.split(r"[{ ]", line)[0] for line in text.splitlines() if line and not line.startswith("#")}


def family(name: str) -> str:
    for suffix in EXPORTED_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def metric_names_in(text: str) -> set[str]:
    return {family(word) for word in re.findall(r"[a-z][a-z0-9_]*(?::[a-z0-9_]+)?", text)}


def schema_paths() -> set[str]:
    """Every path of the OpenAPI schema at /api/schema/ (the management API and the data plane)."""
    from drf_spectacular.generators import SchemaGenerator

    schema: dict[str, Any] = SchemaGenerator().get_schema(request=None, public=True)
    return set(schema["paths"])


def normalised(path: str) -> str:
    """A path with its parameters unnamed: /api/orgs/{org_pk}/keys/{id}/ is /api/orgs/{}/keys/{}/."""
    return re.sub(r"\{[^}/]*\}|<[^>/]*>", "{}", path)


API_PATH = re.compile(
    r"(?<![\w.:/…])(/(?:v1|v2|api|ws|console|portal|admin|metrics|healthz|readyz)\b[^\s`'\"()\[\]<>|,;…*]*(?:<[^>/\s]+>[^\s`'\"()\[\]<>|,;…*]*)*)"
)


def paths_in(text: str) -> set[str]:
    """The platform paths a page names (``/v1/…``, ``/api/…``, ``/portal/<org>/…`` …), without a query."""
    return {match.partition("?")[0].rstrip(".:") for line in text.splitlines() for match in API_PATH.findall(line)}


# --- the tests ------------------------------------------------------------------------------


def test_every_management_command_and_its_arguments_are_in_the_cli_reference():
    page = (REFERENCE / "cli.md").read_text()
    documented = sections(page)
    commands = project_commands()
    assert len(commands) >= 11, commands
    missing = sorted(name for name in commands if name not in documented)
    assert missing == [], f"docs/reference/cli.md has no '### <command>' section for {missing}"
    undocumented = [
        f"{name} {argument}"
        for name, app in sorted(commands.items())
        for argument in command_arguments(app, name)
        if f"`{argument}" not in documented[name]
    ]
    assert undocumented == [], f"docs/reference/cli.md does not name these arguments in their sections: {undocumented}"


def test_every_exported_metric_is_in_the_metrics_reference(monkeypatch):
    documented = metric_names_in((REFERENCE / "metrics.md").read_text())
    gateway = gateway_metric_families()
    platform = platform_metric_families(monkeypatch)
    worker = {family(name) for name in predict_worker_metrics()}
    assert {"inference_requests", "inference_fallbacks"} <= gateway
    assert {"platform_deployment_replicas_wanted", "platform_reconciliation_ok"} <= platform
    assert "predict:num_requests_running" in worker
    missing = sorted((gateway | platform | worker) - documented)
    assert missing == [], f"docs/reference/metrics.md does not list {missing}"


def test_every_schema_path_is_in_the_api_references():
    documented = {
        normalised(path)
        for page in ("http-api.md", "management-api.md")
        for path in paths_in((REFERENCE / page).read_text())
    }
    paths = schema_paths()
    assert {"/v1/chat/completions", "/api/v1/models", "/api/orgs/{org_pk}/keys/"} <= paths
    missing = sorted(path for path in paths if normalised(path) not in documented)
    assert missing == [], f"docs/reference/http-api.md or management-api.md does not name {missing}"


def test_every_platform_path_the_references_and_guides_name_exists():
    from console.routing import websocket_urlpatterns

    known = {normalised(path) for path in schema_paths()} | {f"/{route.pattern}" for route in websocket_urlpatterns}
    pages = [DOCS / "quickstart.md", *sorted((DOCS / "guides").glob("*.md")), *sorted(REFERENCE.glob("*.md"))]
    invented = []
    for page in pages:
        for path in sorted(paths_in(page.read_text())):
            shaped = normalised(path)
            if shaped in known or any(k.startswith(shaped.rstrip("/") + "/") for k in known):
                continue
            try:
                resolve(re.sub(r"\{\}", "1", shaped))
            except Resolver404:
                invented.append(f"{page.relative_to(ROOT)}: {path}")
    assert invented == [], f"these paths are not the platform's: {invented}"


def test_every_relative_link_of_the_docs_points_at_a_file_and_heading_that_exist():
    files = markdown_files()
    assert DOCS / "README.md" in files
    assert DOCS / "guides" / "models.md" in files
    problems = [problem for path in files for problem in broken_links(path)]
    assert problems == [], problems


# --- the checks themselves ------------------------------------------------------------------


def test_slugs_and_sections_follow_github_and_skip_code():
    text = "# A `b.py` (c): d\n```sh\n# not a heading\n```\n## Same\n## Same\n### one\nx\n### two\ny\n## z\n"
    assert anchors(text) == {"a-bpy-c-d", "same", "same-1", "one", "two", "z"}
    assert sections(text) == {"one": "x\n", "two": "y\n"}
    assert github_slug("python -m core.embedded") == "python--m-coreembedded"


def test_a_broken_link_or_anchor_is_found(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Here\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#here) [gone](missing.md) [bad](other.md#there) [self](#top) [web](https://x.org/a)\n"
        "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n# Top\n"
    )
    assert broken_links(page) == ["page.md: missing.md (no such file)", "page.md: other.md#there (no such heading)"]


def test_paths_and_metric_names_are_read_as_written():
    text = "`GET /api/orgs/{id}/keys/` and `/portal/<org>/batches/`, `/v1` at `http://h:8000/v1`; `x_total`; /v2?a=1."
    assert paths_in(text) == {"/api/orgs/{id}/keys/", "/portal/<org>/batches/", "/v1", "/v2"}
    assert normalised("/api/orgs/{org_pk}/keys/{id}/") == normalised("/api/orgs/{id}/keys/{x}/")
    assert "x" in metric_names_in(text)
    assert metric_names_in("predict:batches_total") == {"predict:batches"}
