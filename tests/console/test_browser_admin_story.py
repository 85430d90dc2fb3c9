"""The platform's story from the console alone, in real Chromium (issue 11's "done when").

A platform admin signs in, registers a new version of a model by artifact URI, deploys it,
starts a canary from the wizard and watches the controller promote it to all the traffic,
restarts one of its replicas, prices the chat model, creates a customer organisation with a
limited key (its secret shown once) and a member, and drafts, finalizes and downloads an
invoice. Then that customer signs in to the portal, creates a key of their own, streams an
answer from the real SmolLM2 in the playground, sees the request and its cost on the usage
page, and opens the invoice and downloads its PDF.

The story's model is served by fake engines (tests/support/fake_engine.py) under a supervisor of its
own, stepped in a thread of this process on a host of its own; the canary's verdict comes
from the controller's own task (``rollout.tasks.canary_tick``) over usage records committed
as the gateway writes them (as in test_rollout_browser.py). The playground streams from the
session's real vLLM replica (the ``engines`` fixture). Usage is persisted and rolled up by the
beat tasks' own functions, called here. Every step saves a screenshot under tests/screenshots/.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import (
    PASSWORD,
    fill_canary_wizard,
    log_in,
    screenshot,
    serve_canary_requests,
    tick_until_decided,
)
from tests.support.gateway import committed, persisted
from tests.support.processes import Gateway, start_gateway

pytestmark = [pytest.mark.browser, pytest.mark.engine]

CHAT = "smollm2-135m-instruct"
FAKE_LAUNCHER = f"{sys.executable} -m tests.support.fake_engine"
# The chat model's price while the story runs (per million tokens), so its cost is not 0.
INPUT_PRICE, OUTPUT_PRICE = "100", "200"


@pytest.mark.django_db
def test_the_story_pages_are_routed():
    """Also makes pytest-django create the test database when this module runs alone: the
    browser test below reaches the database through committed fixtures only."""
    from django.urls import reverse

    assert reverse("console:deployments-replica-restart", kwargs={"replica_id": 3}) == (
        "/console/deployments/replicas/3/restart/"
    )
    assert reverse("console:canary-new", kwargs={"name": "m"}) == "/console/canaries/m/new/"


@dataclass
class Story:
    """What the fixtures committed for the story, by name."""

    tag: str
    model: str  # served by fake engines; v1 deployed, v2's artifact in the store, unregistered
    v2_uri: str
    v2_sha256: str
    customer: str  # a user with PASSWORD and no organisation yet
    organization: str  # the name the admin gives the customer's organisation
    canary_key: Any  # an API key of committed_users' org, whose usage records the controller judges
    made: dict[str, Any] = field(default_factory=dict)  # filled in as the story goes (ids, for cleanup)


def put_artifact(key: str) -> Any:
    """A small artifact in the session's store, as tests/console/test_console_browser.py makes one."""
    from registry.artifacts import get_artifact_store

    with tempfile.TemporaryDirectory() as source:
        (Path(source) / "config.json").write_text('{"max_position_embeddings": 1024}')
        (Path(source) / "model.safetensors").write_bytes(uuid.uuid4().bytes * 256)
        return get_artifact_store().put_directory(source=Path(source), key=key)


@pytest.fixture(scope="module")
def story(committed_users, engines, django_db_blocker) -> Iterator[Story]:
    """story-<tag>:v1 registered and deployed (100 %), v2's artifact stored, the customer's
    account, a key for the canary's traffic. Everything the story made is removed after."""
    from django.contrib.auth import get_user_model

    from accounts.services import api_key_create
    from registry.services import deployment_create, model_version_create

    tag = uuid.uuid4().hex[:6]
    name = f"story-{tag}"
    v1, v2 = put_artifact(f"{name}/v1"), put_artifact(f"{name}/v2")

    def create() -> Story:
        version, _ = model_version_create(
            actor=None, name=name, version="v1", framework="pytorch", artifact_uri=v1.uri,
            config={"max_seq_len": 1024}, task="chat",
        )  # fmt: skip
        deployment_create(version=version, replicas=1, max_replicas=2)
        get_user_model().objects.create_user(username=f"customer-{tag}", password=PASSWORD)
        key = api_key_create(organization=committed_users["org"], name=f"story canary {tag}").api_key
        return Story(tag=tag, model=name, v2_uri=v2.uri, v2_sha256=v2.sha256, customer=f"customer-{tag}",
                     organization=f"Story Customer {tag}", canary_key=key)  # fmt: skip

    made = committed(django_db_blocker, create)
    yield made
    committed(django_db_blocker, lambda: remove_story(made))


def remove_story(story: Story) -> None:
    from django.contrib.auth import get_user_model
    from django.db.models import ProtectedError
    from django.utils import timezone

    from accounts.models import ApiKey, Organization
    from billing.models import Invoice, InvoiceLine, Price, UsageRecord, UsageRollup
    from core.events import publish_routing_change
    from registry.models import Deployment, Model, ModelVersion
    from rollout.models import Canary

    organization = Organization.objects.filter(name=story.organization).first()
    keys = ApiKey.objects.filter(pk=story.canary_key.pk)
    if organization is not None:
        keys = keys | ApiKey.objects.filter(organization=organization)
    UsageRollup.objects.filter(api_key__in=keys).delete()
    UsageRecord.objects.filter(api_key__in=keys).delete()
    if organization is not None:
        InvoiceLine.objects.filter(invoice__organization=organization).delete()
        Invoice.objects.filter(organization=organization, reissue_of__isnull=False).delete()
        Invoice.objects.filter(organization=organization).delete()
        ApiKey.objects.filter(organization=organization).delete()
        organization.delete()
    ApiKey.objects.filter(pk=story.canary_key.pk).delete()
    get_user_model().objects.filter(username=story.customer).delete()
    price_id = story.made.get("price_id")
    if price_id is not None:
        try:
            Price.objects.filter(pk=price_id).delete()
        except ProtectedError:  # another request was charged at it meanwhile: end it instead
            Price.objects.filter(pk=price_id).update(effective_to=timezone.now())
        publish_routing_change("prices")
    model = Model.objects.filter(name=story.model).first()
    if model is not None:
        Canary.objects.filter(model=model).delete()
        Deployment.objects.filter(version__model=model).delete()  # replicas go with them
        ModelVersion.objects.filter(model=model).delete()
        model.delete()
        publish_routing_change("deployments")


class SupervisorThread:
    """The story model's supervisor (``serving.supervisor.host.Supervisor``, serving only that model,
    with the fake engine as its launcher), stepped every 0.2 s in a thread of its own, as
    ``runworkers`` steps it. ``paused()`` holds it between two steps."""

    def __init__(self, model: str, log_dir: Path) -> None:
        from serving.supervisor.host import Supervisor

        self.messages: list[str] = []
        self.errors: list[str] = []
        self.supervisor = Supervisor(
            host=f"story-host-{uuid.uuid4().hex[:8]}", slots=["0", "1"], models=frozenset({model}),
            log_dir=log_dir, report=self.messages.append,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="story-supervisor", daemon=True)

    def start(self) -> SupervisorThread:
        self._thread.start()
        return self

    def _loop(self) -> None:
        from django.db import connection

        try:
            while not self._stop.is_set():
                with self._lock:
                    self.supervisor.step()
                self._stop.wait(0.2)
        except Exception:  # noqa: BLE001 - a dead loop fails the module at teardown, with its traceback
            self.errors.append(traceback.format_exc())
        finally:
            connection.close()

    def paused(self) -> threading.Lock:
        """``with thread.paused():`` no step runs inside (one under way finishes first)."""
        return self._lock

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.supervisor.close()


@pytest.fixture(scope="module")
def story_supervisor(story, django_db_blocker, tmp_path_factory) -> Iterator[SupervisorThread]:
    from django.test import override_settings

    # The thread uses the database for the whole module: pytest-django blocks it outside
    # database fixtures, process-wide, so it stays unblocked until the thread has stopped.
    with (
        override_settings(
            WORKER_ENGINE_LAUNCHER=FAKE_LAUNCHER, WORKER_HEARTBEAT_SECONDS=0.5, WORKER_DRAIN_TIMEOUT=5,
            WORKER_MAX_BACKOFF=1,
        ),
        django_db_blocker.unblock(),
    ):  # fmt: skip
        thread = SupervisorThread(story.model, tmp_path_factory.mktemp("story-engines")).start()
        try:
            yield thread
        finally:
            thread.stop()
    assert not thread.errors, thread.errors[0]


@pytest.fixture(scope="module")
def story_gateway(engines, tmp_path_factory) -> Iterator[Gateway]:
    """The console, portal and API in a daphne process started once the real engines are ready."""
    gw = start_gateway(tmp_path_factory.mktemp("story-gateway"), ROUTING_REFRESH_SECONDS="0.5")
    yield gw
    gw.stop()


# --- Helpers ------------------------------------------------------------------------------


def reload_until(page: Any, check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Reload a server-rendered page until ``check`` holds on it (the page does not update itself)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            screenshot(page, f"story-timeout-{what}")
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        page.wait_for_timeout(300)
        page.reload()


def deployment_rows(page: Any, model: str) -> dict[str, dict[str, str]]:
    """The board's deployments of ``model`` by version: id, status and weight as shown."""
    rows = page.locator(f"section[data-model='{model}'] table.deployments tbody tr")
    shown = {}
    for i in range(rows.count()):
        row = rows.nth(i)
        shown[row.locator("td.version [data-version]").inner_text()] = {
            "id": row.get_attribute("data-deployment") or "",
            "status": row.locator("[data-live=status]").inner_text(),
            "weight": row.locator("td.weight").inner_text(),
        }
    return shown


# --- The story ----------------------------------------------------------------------------


def test_the_admin_story_from_the_console_to_the_customers_portal(
    story, story_supervisor, story_gateway, committed_users, chromium, django_db_blocker, tmp_path
):
    context = chromium.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    page = context.new_page()
    try:
        admin_rolls_out_a_new_version(page, story_gateway.base_url, story, story_supervisor, committed_users,
                                      django_db_blocker)  # fmt: skip
        admin_sets_up_a_customer(page, story_gateway.base_url, story, django_db_blocker, tmp_path)
        context.close()
        context = chromium.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
        page = context.new_page()
        customer_uses_the_portal(page, story_gateway.base_url, story, django_db_blocker, tmp_path)
    except Exception:
        screenshot(page, "story-failure")
        raise
    finally:
        context.close()


def admin_rolls_out_a_new_version(
    page: Any, base: str, story: Story, supervisor: SupervisorThread, users: dict[str, Any], django_db_blocker: Any
) -> None:
    name = story.model
    log_in(page, base, users["platform_admin"].username)
    page.wait_for_selector("h1:has-text('Overview')")
    screenshot(page, "story-01-admin-logged-in")

    # The model's v1 serves (its fake engine came up under the story's supervisor).
    page.goto(f"{base}/console/deployments/?model={name}")
    reload_until(page, lambda: deployment_rows(page, name).get("v1", {}).get("status") == "Running", "v1 running")
    screenshot(page, "story-02-v1-serving")

    # Register v2 by its artifact URI on the registry page.
    page.click("nav[aria-label=Console] a:has-text('Models')")
    page.click("a:has-text('Register a version')")
    page.wait_for_selector("h1:has-text('Register a version')")
    page.fill("#id_name", name)
    page.fill("#id_version", "v2")
    page.fill("#id_framework", "pytorch")
    page.fill("#id_artifact_uri", story.v2_uri)
    page.fill("#id_config", '{"max_seq_len": 1024}')
    screenshot(page, "story-03-register-form")
    page.click("#register-submit")
    page.wait_for_selector(".message-success")
    assert story.v2_sha256 in page.locator(".message-success").inner_text()
    assert page.locator("[data-checksum]").inner_text().strip() == story.v2_sha256
    screenshot(page, "story-04-v2-registered")

    # Deploy it beside v1, with no traffic yet; its replica starts and becomes ready.
    page.click("nav[aria-label=Console] a:has-text('Deployments')")
    page.fill("#filter-model", name)
    page.locator("form.filters button[type=submit]").click()
    panel = page.locator(f"section[data-model='{name}']")
    panel.get_by_role("button", name="Deploy a version…").click()
    deploy = page.locator("dialog.drawer[open] form[action$='/deploy/']")
    deploy.locator("select[name$='-version']").select_option("v2")
    deploy.locator("input[name$='-traffic_percent']").fill("0")
    deploy.locator("input[name$='-replicas']").fill("1")
    screenshot(page, "story-05-deploy-form")
    deploy.locator("button[type=submit]").click()
    page.wait_for_selector(".message-success")
    assert f"Deployed {name}:v2 as deployment" in page.locator(".messages").inner_text()
    reload_until(page, lambda: deployment_rows(page, name).get("v2", {}).get("status") == "Running", "v2 running")
    assert deployment_rows(page, name)["v2"]["weight"] == "0 %"
    screenshot(page, "story-06-v2-deployed")

    # The canary wizard: v1 → v2 in two steps, promoted without a person when both pass.
    page.click("nav[aria-label=Console] a:has-text('Canaries')")
    page.fill("#filter-model", name)
    page.locator("form.filters button[type=submit]").click()
    page.locator(f"tr[data-model='{name}'] a:has-text('Start a canary')").click()
    page.wait_for_selector("h1:has-text('Start a canary')")
    fill_canary_wizard(page, steps="10,100", interval="2", min_samples="20", max_p99_ms="60000", min_success="95",
                       auto_promote=True)  # fmt: skip
    screenshot(page, "story-07-canary-wizard")
    page.click("[data-wizard-submit]")
    page.wait_for_selector("[data-canary-status]")
    assert page.locator("[data-canary-status]").inner_text() == "Running"
    assert "v1 90 % · v2 10 %" in page.locator(".facts").inner_text()
    screenshot(page, "story-08-canary-running")

    # Requests are answered by both versions; the controller's beat judges the window; the
    # page, left alone, shows the decision and v2 with all the traffic.
    committed(django_db_blocker, lambda: serve_canary_requests(name, story.canary_key))
    assert committed(django_db_blocker, tick_until_decided) == 1
    page.wait_for_selector("[data-decision][data-verdict='promote']", timeout=20_000)
    page.wait_for_selector("[data-canary-status]:has-text('Promoted')")
    assert "v1 0 % · v2 100 %" in page.locator(".facts").inner_text()
    assert "every step passed: promoted" in page.locator("[data-decision]").first.inner_text()
    screenshot(page, "story-09-canary-promoted")
    page.goto(f"{base}/console/deployments/?model={name}")
    shown = deployment_rows(page, name)
    assert (shown["v1"]["weight"], shown["v2"]["weight"]) == ("0 %", "100 %")
    screenshot(page, "story-10-v2-takes-all-traffic")

    # Restart v2's replica: asked with a confirm step, shown as requested until the supervisor
    # has started it again (held for a moment so the page can show the request).
    v2 = shown["v2"]["id"]
    detail = page.locator(f"dialog#drawer-replicas-{v2}")
    page.locator(f"[data-drawer='drawer-replicas-{v2}']").click()
    replica_row = detail.locator("table.replicas tbody tr[data-replica]").first
    replica_id = int(replica_row.get_attribute("data-replica") or 0)
    pid_before = committed(django_db_blocker, lambda: replica_pid(replica_id))
    with supervisor.paused():
        replica_row.get_by_role("button", name="Restart").click()
        page.wait_for_selector(f"h1:has-text('Restart replica #{replica_id}?')")
        screenshot(page, "story-11-restart-confirm")
        page.get_by_role("button", name=f"Restart replica #{replica_id}").click()
        page.wait_for_selector(".message-success")
        assert f"Restart of replica {replica_id} requested" in page.locator(".messages").inner_text()
        assert "1 restarting" in page.locator(f"tr[data-deployment='{v2}'] [data-live=replicas]").inner_text()
        page.locator(f"[data-drawer='drawer-replicas-{v2}']").click()
        assert detail.locator(f"tr[data-replica='{replica_id}'] [data-restart-requested]").is_visible()
        screenshot(page, "story-12-restart-requested")

    def restarted() -> bool:
        row = page.locator(f"tr[data-replica='{replica_id}']")
        return row.locator("[data-restart-requested]").count() == 0 and row.locator(".status-ready").count() == 1

    reload_until(page, restarted, "replica restarted")
    page.locator(f"[data-drawer='drawer-replicas-{v2}']").click()
    assert committed(django_db_blocker, lambda: replica_pid(replica_id)) not in (None, pid_before)
    assert any(f"replica {replica_id} stopped for its restart" in m for m in supervisor.messages)
    screenshot(page, "story-13-replica-restarted")
    page.keyboard.press("Escape")  # the drawer closes; the page is usable again

    # Price the chat model the customer will use, so their requests cost something.
    page.click("nav[aria-label=Console] a:has-text('Prices')")
    page.wait_for_selector("h1:has-text('Prices')")
    page.select_option("#id_price-model", CHAT)
    page.fill("#id_price-input_per_million", INPUT_PRICE)
    page.fill("#id_price-output_per_million", OUTPUT_PRICE)
    page.click("#set-price button[type=submit]")
    page.wait_for_selector(".message-success")
    assert f"Price of {CHAT} set from" in page.locator(".messages").inner_text()
    story.made["price_id"] = committed(django_db_blocker, lambda: latest_price_id(CHAT))
    screenshot(page, "story-14-chat-model-priced")


def replica_pid(replica_id: int) -> int | None:
    from registry.models import Replica

    return Replica.objects.get(pk=replica_id).pid


def latest_price_id(model: str) -> int:
    from billing.models import Price

    return int(Price.objects.filter(model__name=model).order_by("-id").values_list("pk", flat=True)[0])


def admin_sets_up_a_customer(page: Any, base: str, story: Story, django_db_blocker: Any, tmp_path: Path) -> None:
    # A new organisation on the Customers page.
    page.click("nav[aria-label=Console] a:has-text('Customers')")
    page.wait_for_selector("h1:has-text('Customers')")
    page.fill("#id_new-name", story.organization)
    page.select_option("#id_new-tier", "paid")
    page.fill("#id_new-billing_email", "invoices@story.example")
    page.fill("#id_new-tax_percent", "10")
    page.fill("#id_new-monthly_spend_cap", "500")
    screenshot(page, "story-15-new-customer")
    page.click("#create button[type=submit]")
    page.wait_for_selector(f"h1:has-text('{story.organization}')")
    assert "created." in page.locator(".messages").inner_text()

    # The customer's account becomes the organisation's admin.
    page.fill("#id_member-username", story.customer)
    page.select_option("#id_member-role", "org_admin")
    page.click("#members form:not(.cust-inline) button[type=submit]")
    page.wait_for_selector(f"#member-list th:has-text('{story.customer}')")
    assert f"{story.customer} is added as Org admin" in page.locator(".messages").inner_text()
    screenshot(page, "story-16-customer-admin-added")

    # A key with limits: its secret on this answer only.
    page.click("a:has-text('Create a key')")
    page.wait_for_selector("h1:has-text('Create an API key')")
    page.fill("#id_name", "production")
    page.fill("#id_rate_limit_rpm", "60")
    page.fill("#id_rate_limit_tpm", "50000")
    page.fill("#id_max_concurrent", "4")
    page.fill("#id_monthly_spend_cap", "100")
    page.click("button:has-text('Create key')")
    page.wait_for_selector("#api-key-secret")
    secret = page.input_value("#api-key-secret")
    assert secret.startswith("sk-")
    assert "60 requests/min · 50k tokens/min · 4 at once" in page.locator(".cust-secret").inner_text()
    screenshot(page, "story-17-customer-key-secret-once")
    page.click("a:has-text('Done: back to')")
    page.wait_for_selector("#key-list")
    assert "production" in page.locator("#key-list").inner_text()
    assert secret not in page.content()

    # Last month's invoice: drafted, finalized, its PDF downloaded.
    page.click("nav[aria-label='This organisation'] a:has-text('Invoices')")
    page.wait_for_selector("h2:has-text('Draft an invoice')")
    page.click("#draft button[type=submit]")
    page.wait_for_selector("#invoice-state:has-text('Draft')")
    assert "drafted" in page.locator(".messages").inner_text()
    screenshot(page, "story-18-invoice-draft")
    page.click("button:has-text('Finalize')")
    page.wait_for_selector("#invoice-state:has-text('Finalized')")
    assert "finalized" in page.locator(".messages").inner_text()
    with page.expect_download() as download_info:
        page.click("#download-pdf")
    download = download_info.value
    saved = tmp_path / download.suggested_filename
    download.save_as(str(saved))
    assert saved.name.endswith(".pdf")
    assert saved.read_bytes().startswith(b"%PDF")
    screenshot(page, "story-19-invoice-finalized-and-downloaded")


def customer_uses_the_portal(page: Any, base: str, story: Story, django_db_blocker: Any, tmp_path: Path) -> None:
    from billing.tasks import usage_rollups_build
    from console.pages.portal_usage import money_text

    # One organisation: the customer lands in its portal.
    log_in(page, base, story.customer)
    org_id = committed(django_db_blocker, lambda: organization_id(story.organization))
    assert page.url.rstrip("/").endswith(f"/portal/{org_id}"), page.url
    page.wait_for_selector("#total-requests")
    assert page.inner_text("#total-requests") == "0"
    screenshot(page, "story-20-customer-portal")

    # A key of their own, its secret shown once.
    page.get_by_role("link", name="API keys", exact=True).click()
    page.get_by_role("link", name="Create a key").click()
    page.get_by_label("Name").fill("my app")
    page.get_by_label("Requests per minute").fill("30")
    page.get_by_role("button", name="Create key").click()
    secret = page.input_value("#api-key-secret")
    assert secret.startswith("sk-")
    screenshot(page, "story-21-customer-key-secret-once")
    page.get_by_role("link", name="back to the keys").click()
    assert secret not in page.content()
    assert "my app" in page.locator("#keys").inner_text()
    screenshot(page, "story-22-customer-keys")

    # The playground streams from the real model.
    page.get_by_role("link", name="Playground", exact=True).click()
    page.select_option("#pg-model-a", CHAT)
    page.fill("#pg-message", "Name three colours of the rainbow.")
    page.fill("#pg-max-tokens", "24")
    page.uncheck("#pg-cache")
    page.click("#pg-send")
    page.wait_for_function(
        "Number(document.querySelector(\".pg-column[data-column='a'] [data-field='tokens']\").textContent) >= 1",
        timeout=180_000,
    )
    screenshot(page, "story-23-playground-streaming")
    page.wait_for_selector(".pg-column[data-column='a'][data-state='completed']", timeout=180_000)
    column = page.locator(".pg-column[data-column='a']")
    assert column.locator("[data-field='output']").inner_text().strip()
    request_id = column.get_attribute("data-request-id")
    assert request_id
    screenshot(page, "story-24-playground-answered")

    # The usage stream is persisted and rolled up, as the beat tasks do; the usage page shows it.
    record = committed(django_db_blocker, lambda: persisted([request_id])[request_id])
    assert record.organization_id == org_id
    assert record.cost > 0
    committed(django_db_blocker, usage_rollups_build)
    page.get_by_role("link", name="Usage", exact=True).click()
    page.wait_for_selector("#chart-cost .main-svg")
    assert page.inner_text("#total-requests") == "1"
    assert page.inner_text("#total-output") == f"{record.completion_tokens:,}"
    assert page.inner_text("#total-cost") == money_text(record.cost)
    assert CHAT in page.inner_text("#usage-by-model")
    screenshot(page, "story-25-customer-usage-and-cost")

    # The invoice the admin finalized, in the customer's own portal, with its PDF.
    page.get_by_role("link", name="Invoices", exact=True).click()
    page.wait_for_selector("#invoices")
    rows = page.locator("#invoices tbody tr")
    assert rows.count() == 1
    assert "Due " in rows.first.inner_text()  # finalized: its due day (issue 40, item 10)
    rows.first.locator("th a").click()
    page.wait_for_selector("#download-pdf")
    screenshot(page, "story-26-customer-invoice")
    with page.expect_download() as download_info:
        page.click("#download-pdf")
    saved = tmp_path / f"customer-{download_info.value.suggested_filename}"
    download_info.value.save_as(str(saved))
    assert saved.read_bytes().startswith(b"%PDF")


def organization_id(name: str) -> int:
    from accounts.models import Organization

    return int(Organization.objects.get(name=name).pk)
