"""Bad webhook URLs by hand, against a real gateway (issue 34): a batch whose ``callback_url``
would reach an internal address, however written (every form in docs/webhooks.md, 6to4,
NAT64, Teredo, ISATAP, numbers the resolver reads as 127.0.0.1, a zone, userinfo), is a 400 in
OpenAI's error shape naming ``callback_url``, and nothing is stored, queued, sent or billed.

No engine: the batch would only be queued. A public callback URL, sent last, makes a batch,
so the checks can see one.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.gateway import ApiKeyFixture, committed, register_fake_replica
from tests.support.processes import Gateway, start_gateway

pytestmark = pytest.mark.django_db

REFUSED = [
    # (callback_url, the address the refusal names)
    ("http://[2002:7f00:1::]/hook", "2002:7f00:1::"),
    ("http://[2002:a9fe:a9fe::]/latest/meta-data/", "2002:a9fe:a9fe::"),
    ("http://[2002:101:101::1]/hook", "2002:101:101::1"),
    ("http://127.0.0.1:8000/hook", "127.0.0.1"),
    ("http://[::1]/hook", "::1"),
    ("http://10.0.0.1/hook", "10.0.0.1"),
    ("http://172.16.0.1/hook", "172.16.0.1"),
    ("http://192.168.1.1/hook", "192.168.1.1"),
    ("http://[fd00:ec2::254]/latest/meta-data/", "fd00:ec2::254"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),
    ("http://[fe80::1]/hook", "fe80::1"),
    ("http://100.64.0.1/hook", "100.64.0.1"),
    ("http://224.0.0.1/hook", "224.0.0.1"),
    ("http://240.0.0.1/hook", "240.0.0.1"),
    ("http://0.0.0.0/hook", "0.0.0.0"),
    ("http://[::]/hook", "::"),
    ("http://[::ffff:127.0.0.1]/hook", "::ffff:127.0.0.1"),
    ("http://[::ffff:a9fe:a9fe]/hook", "::ffff:a9fe:a9fe"),
    ("http://[::127.0.0.1]/hook", "::127.0.0.1"),
    ("http://[64:ff9b::a9fe:a9fe]/latest/meta-data/", "64:ff9b::a9fe:a9fe"),
    ("http://[64:ff9b:1::101:101]/hook", "64:ff9b:1::101:101"),
    ("http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/hook", "2001:0:4136:e378:8000:63bf:80ff:fffe"),
    ("http://[2600::5efe:a9fe:a9fe]/hook", "2600::5efe:a9fe:a9fe"),
    ("http://[fec0::1]/hook", "fec0::1"),
    ("http://2130706433/hook", "127.0.0.1"),
    ("http://0x7f.1/hook", "127.0.0.1"),
    ("http://017700000001/hook", "127.0.0.1"),
    ("http://127.1/hook", "127.0.0.1"),
    ("http://[fe80::1%25eth0]/hook", "fe80::1"),
    ("http://public.example@127.0.0.1/hook", "127.0.0.1"),
    ("HTTP://169.254.169.254/latest/meta-data/", "169.254.169.254"),
]

NOT_WEB_ADDRESSES = [
    ("gopher://127.0.0.1:6379/_INFO", "must be an http or https URL"),
    ("file:///etc/passwd", "must be an http or https URL"),
    ("http://1.1.1.1:99999/hook", "port must be between 1 and 65535"),
    ("http://[2606:4700:4700::1111%25eth0]/hook", "IPv6 zone"),
]


@pytest.fixture(scope="module")
def model_name(django_db_setup, django_db_blocker) -> str:
    """A chat model with a ready replica nobody answers at: no batch of this module runs."""
    name = f"webhook-bad-{uuid.uuid4().hex[:8]}"
    committed(django_db_blocker, lambda: register_fake_replica(name, "http://127.0.0.1:9"))
    return name


@pytest.fixture(scope="module")
def webhook_gateway(model_name, tmp_path_factory) -> Iterator[Gateway]:
    started = start_gateway(tmp_path_factory.mktemp("webhook-gateway"), WEBHOOK_ALLOW_PRIVATE_ADDRESSES="false")
    yield started
    started.stop()


@pytest.fixture
def tenant(api_key, django_db_blocker) -> Iterator[ApiKeyFixture]:
    """A key of a new organisation; any batch made for it is deleted after the test (no batch
    worker runs here, but a later test's might)."""
    from serving.models import Batch

    yield api_key
    committed(django_db_blocker, lambda: Batch.objects.filter(organization_id=api_key.organization_id).delete())


def _create(gateway: Gateway, key: ApiKeyFixture, model: str, callback_url: Any) -> httpx.Response:
    return httpx.post(
        f"{gateway.base_url}/api/v1/batch",
        headers={"Authorization": f"Bearer {key.secret}"},
        json={"model": model, "inputs": ["hello"], "callback_url": callback_url},
        timeout=30,
    )


def _left_behind(organization_id: int) -> dict[str, int]:
    from billing.models import UsageRecord
    from serving.models import Batch, StoredFile, WebhookDelivery

    return {
        "batches": Batch.objects.filter(organization_id=organization_id).count(),
        "files": StoredFile.objects.filter(organization_id=organization_id).count(),
        "webhooks": WebhookDelivery.objects.filter(organization_id=organization_id).count(),
        "usage": UsageRecord.objects.filter(organization_id=organization_id).count(),
    }


NOTHING = {"batches": 0, "files": 0, "webhooks": 0, "usage": 0}


def _refusal(answer: httpx.Response) -> str:
    """The message of a 400 in OpenAI's error shape naming callback_url."""
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    body = answer.json()
    message = body["error"]["message"]
    assert isinstance(message, str)
    expected = {"message": message, "type": "invalid_request_error", "param": "callback_url"}
    assert body == {"error": {**expected, "code": "invalid_callback_url"}}
    return message


@pytest.mark.parametrize(("url", "address"), REFUSED, ids=[url for url, _ in REFUSED])
def test_an_internal_callback_url_is_refused_and_nothing_is_made(
    webhook_gateway, model_name, tenant, django_db_blocker, url, address
):
    message = _refusal(_create(webhook_gateway, tenant, model_name, url))
    assert message.startswith(f"callback_url resolves to {address}, an internal address")
    assert message.endswith(
        "the operator has not allowed webhooks to internal addresses (WEBHOOK_ALLOW_PRIVATE_ADDRESSES)"
    )
    assert committed(django_db_blocker, lambda: _left_behind(tenant.organization_id)) == NOTHING


@pytest.mark.parametrize(("url", "why"), NOT_WEB_ADDRESSES, ids=[url for url, _ in NOT_WEB_ADDRESSES])
def test_a_callback_url_no_webhook_can_use_is_refused(webhook_gateway, model_name, tenant, django_db_blocker, url, why):
    assert why in _refusal(_create(webhook_gateway, tenant, model_name, url))
    assert committed(django_db_blocker, lambda: _left_behind(tenant.organization_id)) == NOTHING


def test_a_public_callback_url_makes_the_batch(webhook_gateway, model_name, tenant, django_db_blocker):
    """The control: the same request with a public address is accepted, and the checks above
    would have seen its batch and file."""
    from serving.models import Batch

    answer = _create(webhook_gateway, tenant, model_name, "http://[64:ff9b::1.1.1.1]:8443/hook")
    assert answer.status_code == 202, answer.text
    made = committed(django_db_blocker, lambda: _left_behind(tenant.organization_id))
    assert made == {**NOTHING, "batches": 1, "files": 1}
    stored = committed(django_db_blocker, lambda: Batch.objects.get(public_id=answer.json()["batch_id"]))
    assert stored.callback_url == "http://[64:ff9b::1.1.1.1]:8443/hook"
