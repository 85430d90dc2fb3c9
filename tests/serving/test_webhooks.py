"""Signed, retried webhooks (serving.batches.webhooks): the signature, which addresses they may go to,
and delivery to a real HTTP receiver on this machine, with retries, give-up and refusals."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
import pytest
from django.utils import timezone

from accounts.services import organization_create, organization_webhook_secret
from serving.batches.webhooks import (
    SIGNATURE_HEADER,
    BadCallback,
    UnresolvedCallback,
    check_callback_url,
    deliveries_of,
    sign,
    verify,
    webhook_enqueue,
    webhooks_deliver_due,
)
from serving.models import WebhookDelivery

pytestmark = pytest.mark.django_db

SECRET = "whsec_test-secret"
BODY = b'{"id":"batch_1","status":"completed"}'
INTERNAL = (
    "callback_url resolves to 127.0.0.1, an internal address; the operator has not allowed webhooks to "
    "internal addresses (WEBHOOK_ALLOW_PRIVATE_ADDRESSES)"
)


# --- Receivers and a fake resolver -----------------------------------------------------


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    verified: bool


@dataclass
class Receiver:
    """An HTTP server on 127.0.0.1 that answers the scripted statuses in turn (then the last one
    again) and checks each request's signature with ``secret``."""

    statuses: list[int]
    secret: str = ""
    requests: list[Received] = field(default_factory=list)
    port: int = 0

    def url(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}/hooks/batch"


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    servers: list[ThreadingHTTPServer] = []

    def start(*statuses: int, secret: str = "") -> Receiver:
        state = Receiver(statuses=list(statuses), secret=secret)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                signature = self.headers.get(SIGNATURE_HEADER, "")
                state.requests.append(Received(dict(self.headers.items()), body, verify(state.secret, body, signature)))
                status = state.statuses[min(len(state.requests), len(state.statuses)) - 1]
                answer = b"not now" if status >= 300 else b"ok"
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", "http://127.0.0.1:1/elsewhere")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        state.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return state

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def dns(monkeypatch) -> dict[str, list[str]]:
    """Names this test resolves itself (name → addresses; an empty list: does not resolve);
    every other name goes to the real resolver. ``dns["asked"]`` lists the names looked up."""
    table: dict[str, list[str]] = {"asked": []}
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        name = host.decode() if isinstance(host, bytes) else str(host)
        if name not in table:
            return real(host, port, *args, **kwargs)
        table["asked"].append(name)
        if not table[name]:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, int(port or 0)))
            for a in table[name]
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return table


@pytest.fixture
def org():
    return organization_create(name="Webhook Corp")


@pytest.fixture
def private_allowed(settings):
    """The receivers listen on 127.0.0.1: allowed, and retried at once."""
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True
    settings.WEBHOOK_BACKOFF_SECONDS = 0
    return settings


def _enqueue(org, url: str, **payload: Any) -> WebhookDelivery:
    return webhook_enqueue(
        organization_id=org.pk, url=url, event="batch.completed", payload=payload or {"id": "batch_1"}
    )


# --- Signatures ------------------------------------------------------------------------


class TestSignature:
    def test_it_round_trips(self):
        now = time.time()
        header = sign(SECRET, BODY, timestamp=int(now))
        assert header.startswith(f"t={int(now)},v1=")
        assert verify(SECRET, BODY, header, now=now)

    def test_it_refuses_a_tampered_body(self):
        header = sign(SECRET, BODY, timestamp=int(time.time()))
        assert not verify(SECRET, BODY.replace(b"completed", b"failed"), header)

    def test_it_refuses_another_secret(self):
        header = sign(SECRET, BODY, timestamp=int(time.time()))
        assert not verify("whsec_other", BODY, header)

    def test_it_refuses_a_timestamp_outside_the_tolerance(self):
        now = time.time()
        old = sign(SECRET, BODY, timestamp=int(now) - 301)
        future = sign(SECRET, BODY, timestamp=int(now) + 301)
        assert not verify(SECRET, BODY, old, now=now)
        assert not verify(SECRET, BODY, future, now=now)
        assert verify(SECRET, BODY, old, now=now, tolerance=600)

    def test_the_timestamp_is_signed(self):
        now = int(time.time())
        header = sign(SECRET, BODY, timestamp=now - 1000)
        replayed = header.replace(f"t={now - 1000}", f"t={now}")
        assert not verify(SECRET, BODY, replayed, now=now)

    def test_a_rotated_secret_verifies_while_either_signature_is_sent(self):
        now = int(time.time())
        old, new = "whsec_old", "whsec_new"
        signed_new = sign(new, BODY, timestamp=now)
        assert verify(new, BODY, signed_new)
        assert not verify(old, BODY, signed_new)
        both = signed_new + "," + sign(old, BODY, timestamp=now).split(",")[1]
        assert verify(new, BODY, both)
        assert verify(old, BODY, both)
        assert not verify("whsec_third", BODY, both)

    @pytest.mark.parametrize(
        "header", ["", "v1=abc", "t=123", "t=abc,v1=abc", "t=1,t=2,v1=abc", "garbage", "t=,v1=", "t=1,v1=é"]
    )
    def test_it_refuses_a_malformed_header(self, header):
        assert not verify(SECRET, BODY, header, now=1)


# --- Where webhooks may go -------------------------------------------------------------


class TestCheckCallbackUrl:
    def test_it_refuses_loopback_naming_the_address(self):
        with pytest.raises(BadCallback) as refused:
            check_callback_url("http://127.0.0.1:8000/hook")
        assert refused.value.message == INTERNAL

    @pytest.mark.parametrize(
        ("url", "address"),
        [
            ("http://localhost:8000/hook", None),  # 127.0.0.1 or ::1, as this machine's resolver says
            ("https://10.0.0.1/hook", "10.0.0.1"),
            ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),
            ("http://[::1]/hook", "::1"),
            ("http://[::ffff:127.0.0.1]/hook", "::ffff:127.0.0.1"),
            ("http://100.64.0.1/hook", "100.64.0.1"),
            ("http://0.0.0.0/hook", "0.0.0.0"),
            ("http://224.0.0.1/hook", "224.0.0.1"),
        ],
    )
    def test_it_refuses_internal_addresses(self, url, address):
        with pytest.raises(BadCallback, match="an internal address") as refused:
            check_callback_url(url)
        if address is not None:
            assert f"resolves to {address}," in refused.value.message

    @pytest.mark.parametrize(
        ("url", "why"),
        [
            ("ftp://example.com/hook", "must be an http or https URL"),
            ("file:///etc/passwd", "must be an http or https URL"),
            ("example.com/hook", "must be an http or https URL"),
            ("http:///hook", "must name a host"),
            ("https://example.com/" + "a" * 2000, "at most 2000 characters"),
        ],
    )
    def test_it_refuses_what_is_not_a_web_address(self, url, why):
        with pytest.raises(BadCallback, match=why):
            check_callback_url(url)

    def test_it_refuses_a_name_when_any_address_is_internal(self, dns):
        dns["hooks.example.com"] = ["1.1.1.1", "10.1.2.3"]
        with pytest.raises(BadCallback, match=r"resolves to 10\.1\.2\.3, an internal address"):
            check_callback_url("https://hooks.example.com/batch")

    def test_it_allows_a_public_name(self, dns):
        dns["hooks.example.com"] = ["1.1.1.1", "2606:4700:4700::1111"]
        assert check_callback_url("https://hooks.example.com/batch") == "https://hooks.example.com/batch"
        assert check_callback_url("https://[::ffff:1.1.1.1]/batch") == "https://[::ffff:1.1.1.1]/batch"

    def test_it_refuses_a_name_that_does_not_resolve(self, dns):
        dns["nowhere.example.com"] = []
        with pytest.raises(UnresolvedCallback, match="does not resolve"):
            check_callback_url("https://nowhere.example.com/batch")

    def test_the_operator_may_allow_internal_addresses(self, settings):
        settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True
        for url in ("http://127.0.0.1:8000/hook", "http://localhost/hook", "http://10.0.0.1/", "http://[::1]/"):
            assert check_callback_url(url) == url
        with pytest.raises(BadCallback, match="http or https"):
            check_callback_url("ftp://127.0.0.1/")

    def test_the_operator_may_allow_names_whatever_they_resolve_to(self, settings, dns):
        settings.WEBHOOK_ALLOWED_HOSTS = ("localhost", "Hooks.Internal")
        dns["hooks.internal"] = []  # not even resolved: the operator vouches for the name
        assert check_callback_url("http://localhost:9000/hook") == "http://localhost:9000/hook"
        assert check_callback_url("https://hooks.internal/batch") == "https://hooks.internal/batch"
        assert dns["asked"] == []
        with pytest.raises(BadCallback, match="internal address"):
            check_callback_url("http://127.0.0.1:9000/hook")


# --- Every way of writing an internal address (issue 34, defect 10) ----------------------

# (URL, the address the refusal names, what it adds in brackets: "" for none). The IPv6
# forms that carry an IPv4 address are refused for the address they carry, named.
REFUSED_FORMS = [
    # 6to4 (2002::/16): the audit's two, then one wrapping a public address (6to4 is not
    # globally routable in itself)
    ("http://[2002:7f00:1::]/hook", "2002:7f00:1::", "the 6to4 form of 127.0.0.1"),
    ("http://[2002:a9fe:a9fe::]/latest/meta-data/", "2002:a9fe:a9fe::", "the 6to4 form of 169.254.169.254"),
    ("http://[2002:a00:1:1::1]:8080/hook", "2002:a00:1:1::1", "the 6to4 form of 10.0.0.1"),
    ("http://[2002:101:101::1]/hook", "2002:101:101::1", "6to4: 2002::/16 is not globally routable"),
    # docs/webhooks.md's list
    ("http://127.0.0.1/hook", "127.0.0.1", ""),
    ("http://127.255.255.254/hook", "127.255.255.254", ""),
    ("http://[::1]/hook", "::1", ""),
    ("http://10.0.0.1/hook", "10.0.0.1", ""),
    ("http://172.16.0.1/hook", "172.16.0.1", ""),
    ("http://172.31.255.255/hook", "172.31.255.255", ""),
    ("http://192.168.1.1/hook", "192.168.1.1", ""),
    ("http://[fc00::1]/hook", "fc00::1", ""),
    ("http://[fd00:ec2::254]/latest/meta-data/", "fd00:ec2::254", ""),  # AWS's metadata over IPv6
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254", ""),
    ("http://[fe80::1]/hook", "fe80::1", ""),
    ("http://100.64.0.1/hook", "100.64.0.1", ""),
    ("http://100.127.255.254/hook", "100.127.255.254", ""),
    ("http://224.0.0.1/hook", "224.0.0.1", ""),
    ("http://[ff02::1]/hook", "ff02::1", ""),
    ("http://240.0.0.1/hook", "240.0.0.1", ""),
    ("http://255.255.255.255/hook", "255.255.255.255", ""),
    ("http://0.0.0.0/hook", "0.0.0.0", ""),
    ("http://[::]/hook", "::", ""),
    # IPv4-mapped, however written
    ("http://[::ffff:127.0.0.1]/hook", "::ffff:127.0.0.1", "the IPv4-mapped form of 127.0.0.1"),
    ("http://[::ffff:7f00:1]/hook", "::ffff:7f00:1", "the IPv4-mapped form of 127.0.0.1"),
    (
        "http://[0:0:0:0:0:ffff:169.254.169.254]/",
        "0:0:0:0:0:ffff:169.254.169.254",
        "the IPv4-mapped form of 169.254.169.254",
    ),
    # the rest of IANA's special-purpose addresses
    ("http://192.0.0.1/hook", "192.0.0.1", ""),
    ("http://192.0.2.1/hook", "192.0.2.1", ""),
    ("http://192.88.99.1/hook", "192.88.99.1", ""),
    ("http://198.18.0.1/hook", "198.18.0.1", ""),
    ("http://198.51.100.1/hook", "198.51.100.1", ""),
    ("http://203.0.113.1/hook", "203.0.113.1", ""),
    ("http://[2001:db8::1]/hook", "2001:db8::1", ""),
    ("http://[3fff::1]/hook", "3fff::1", ""),
    ("http://[100::1]/hook", "100::1", ""),
    ("http://[5f00::1]/hook", "5f00::1", ""),
    ("http://[fec0::1]/hook", "fec0::1", ""),  # site-local (deprecated, still routed by some networks)
    # IPv4-compatible (deprecated) and IPv4-translated (SIIT)
    ("http://[::127.0.0.1]/hook", "::127.0.0.1", "the IPv4-compatible form of 127.0.0.1"),
    ("http://[::a9fe:a9fe]/hook", "::a9fe:a9fe", "the IPv4-compatible form of 169.254.169.254"),
    ("http://[::ffff:0:a00:1]/hook", "::ffff:0:a00:1", "the IPv4-translated form of 10.0.0.1"),
    # NAT64: the well-known prefix, and the local-use one (refused whatever it wraps)
    ("http://[64:ff9b::127.0.0.1]/hook", "64:ff9b::127.0.0.1", "the NAT64 form of 127.0.0.1"),
    ("http://[64:ff9b::a9fe:a9fe]/latest/meta-data/", "64:ff9b::a9fe:a9fe", "the NAT64 form of 169.254.169.254"),
    ("http://[64:ff9b::c0a8:101]/hook", "64:ff9b::c0a8:101", "the NAT64 form of 192.168.1.1"),
    ("http://[64:ff9b:1::a9fe:a9fe]/hook", "64:ff9b:1::a9fe:a9fe", "the NAT64 form of 169.254.169.254"),
    (
        "http://[64:ff9b:1::101:101]/hook",
        "64:ff9b:1::101:101",
        "local-use NAT64: 64:ff9b:1::/48 is not globally routable",
    ),
    # Teredo (2001::/32): the server, and the client (stored inverted)
    (
        "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/",
        "2001:0:4136:e378:8000:63bf:80ff:fffe",
        "a Teredo address of client 127.0.0.1",
    ),
    (
        "http://[2001:0:a00:1:8000:63bf:fefe:fefe]/",
        "2001:0:a00:1:8000:63bf:fefe:fefe",
        "a Teredo address of server 10.0.0.1",
    ),
    (
        "http://[2001:0:4136:e378:8000:63bf:fefe:fefe]/",
        "2001:0:4136:e378:8000:63bf:fefe:fefe",
        "Teredo: 2001::/32 is not globally routable",
    ),
    # ISATAP (an interface id of 0:5efe or 200:5efe and an IPv4 address), under a public prefix
    ("http://[2600::5efe:7f00:1]/hook", "2600::5efe:7f00:1", "the ISATAP form of 127.0.0.1"),
    ("http://[2600:1:2:3:200:5efe:a9fe:a9fe]/", "2600:1:2:3:200:5efe:a9fe:a9fe", "the ISATAP form of 169.254.169.254"),
    # what the resolver reads as 127.0.0.1 (httpx passes these hosts on as they are)
    ("http://2130706433/hook", "127.0.0.1", ""),
    ("http://0x7f000001/hook", "127.0.0.1", ""),
    ("http://0x7f.1/hook", "127.0.0.1", ""),
    ("http://017700000001/hook", "127.0.0.1", ""),
    ("http://127.1/hook", "127.0.0.1", ""),
    ("http://0/hook", "0.0.0.0", ""),
    # an IPv6 zone, userinfo, an uppercase scheme, ports
    ("http://[fe80::1%25eth0]/hook", "fe80::1", ""),
    ("http://public.example@127.0.0.1/hook", "127.0.0.1", ""),
    ("http://1.1.1.1:443@[::1]:8000/hook", "::1", ""),
    ("HTTP://127.0.0.1/hook", "127.0.0.1", ""),
    ("HttpS://[2002:a9fe:a9fe::]:443/hook", "2002:a9fe:a9fe::", "the 6to4 form of 169.254.169.254"),
    ("http://169.254.169.254:80/latest/meta-data/", "169.254.169.254", ""),
]

# Names this test resolves itself: each to one of the forms above.
RESOLVED_FORMS = [
    ("six-to-four.example.com", "2002:7f00:1::", "the 6to4 form of 127.0.0.1"),
    ("metadata.example.com", "2002:a9fe:a9fe::", "the 6to4 form of 169.254.169.254"),
    ("nat64.example.com", "64:ff9b::a9fe:a9fe", "the NAT64 form of 169.254.169.254"),
    ("teredo.example.com", "2001:0:4136:e378:8000:63bf:80ff:fffe", "a Teredo address of client 127.0.0.1"),
    ("isatap.example.com", "2600::5efe:a00:1", "the ISATAP form of 10.0.0.1"),
    ("compatible.example.com", "::7f00:1", "the IPv4-compatible form of 127.0.0.1"),
    ("mapped.example.com", "::ffff:127.0.0.1", "the IPv4-mapped form of 127.0.0.1"),
    ("linklocal.example.com", "fe80::1", ""),
]


def _internal(address: str, why: str) -> str:
    said = f"an internal address ({why})" if why else "an internal address"
    return (
        f"callback_url resolves to {address}, {said}; the operator has not allowed webhooks to internal "
        "addresses (WEBHOOK_ALLOW_PRIVATE_ADDRESSES)"
    )


class TestAddressForms:
    """Every form of an internal address is refused, naming it and any IPv4 address it wraps;
    the public ones, written any way, are allowed."""

    @pytest.mark.parametrize(("url", "address", "why"), REFUSED_FORMS, ids=[url for url, _, _ in REFUSED_FORMS])
    def test_a_literal_is_refused(self, url, address, why):
        with pytest.raises(BadCallback) as refused:
            check_callback_url(url)
        assert refused.value.message == _internal(address, why)

    @pytest.mark.parametrize(("name", "address", "why"), RESOLVED_FORMS, ids=[name for name, _, _ in RESOLVED_FORMS])
    def test_a_name_resolving_to_it_is_refused(self, dns, name, address, why):
        dns[name] = dns[f"{name}."] = ["1.1.1.1", address]
        for url in (f"https://{name}/hook", f"https://{name}./hook", f"HTTPS://{name.upper()}:8443/hook"):
            with pytest.raises(BadCallback) as refused:
                check_callback_url(url)
            assert refused.value.message == _internal(address, why)

    @pytest.mark.parametrize(
        "url",
        [
            "http://1.1.1.1/hook",
            "HTTPS://1.1.1.1:8443/hook",
            "http://[2606:4700:4700::1111]/hook",
            "http://[::ffff:1.1.1.1]/hook",
            "http://[64:ff9b::1.1.1.1]/hook",  # what DNS64 makes of a public IPv4-only host
            "http://[64:ff9b::808:808]:8080/hook",
            "http://16843009/hook",  # 1.1.1.1 as one number
            "http://user:secret@1.1.1.1/hook",
        ],
    )
    def test_a_public_address_however_written_is_allowed(self, url):
        assert check_callback_url(url) == url

    def test_a_public_name_with_a_trailing_dot_is_allowed(self, dns):
        dns["hooks.example.com."] = ["1.1.1.1", "64:ff9b::101:101"]
        assert check_callback_url("https://hooks.example.com./batch") == "https://hooks.example.com./batch"

    @pytest.mark.parametrize(
        ("url", "why"),
        [
            ("gopher://127.0.0.1:6379/_INFO", "must be an http or https URL"),
            ("javascript:alert(1)", "must be an http or https URL"),
            ("data:text/plain,hi", "must be an http or https URL"),
            ("ws://1.1.1.1/hook", "must be an http or https URL"),
            ("//1.1.1.1/hook", "must be an http or https URL"),
            ("http:/127.0.0.1/hook", "must name a host"),
            ("http://0177.0.0.1/hook", "is not a valid URL"),
            ("http://\uff11\uff12\uff17.\uff10.\uff10.\uff11/hook", "is not a valid URL"),  # full-width digits
            ("http://1.1.1.1:0/hook", "port must be between 1 and 65535"),
            ("http://1.1.1.1:99999/hook", "port must be between 1 and 65535"),
            ("http://[2606:4700:4700::1111%25eth0]/hook", "IPv6 zone"),
        ],
    )
    def test_what_no_webhook_can_use_is_refused(self, url, why):
        with pytest.raises(BadCallback, match=why):
            check_callback_url(url)

    @pytest.mark.parametrize("url", ["http://127.0.0.1./hook", "http://%31%32%37.0.0.1/hook", "http://localhost./hook"])
    def test_a_host_the_resolver_may_read_as_loopback_is_refused(self, url):
        """Whether these resolve depends on the resolver: refused either way."""
        with pytest.raises(BadCallback):
            check_callback_url(url)

    def test_it_is_refused_again_when_sending(self, org, receiver, dns, settings):
        """A name public when given and a wrapped internal address when sent (DNS rebinding)
        fails at once, naming the address, and nothing is sent."""
        settings.WEBHOOK_BACKOFF_SECONDS = 0
        hook = receiver(200)
        dns["hooks.example.com"] = ["1.1.1.1"]
        url = hook.url("hooks.example.com")
        delivery = _enqueue(org, check_callback_url(url))
        dns["hooks.example.com"] = ["2002:7f00:1::"]
        assert webhooks_deliver_due() == 0
        delivery.refresh_from_db()
        assert delivery.status == "failed"
        assert delivery.last_error == _internal("2002:7f00:1::", "the 6to4 form of 127.0.0.1")
        assert hook.requests == []


# --- Delivery --------------------------------------------------------------------------


class TestDelivery:
    def test_it_retries_until_delivered_signed_with_the_organisations_secret(self, org, receiver, private_allowed):
        secret = organization_webhook_secret(organization_id=org.pk)
        hook = receiver(500, 500, 200, secret=secret)
        delivery = _enqueue(org, hook.url(), id="batch_1", status="completed")
        assert delivery.status == WebhookDelivery.Status.PENDING

        assert webhooks_deliver_due() == 1
        delivery.refresh_from_db()
        assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("pending", 1, 500)
        assert delivery.last_error == "the receiver answered 500: not now"

        assert webhooks_deliver_due() == 1
        assert webhooks_deliver_due() == 1
        delivery.refresh_from_db()
        assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("delivered", 3, 200)
        assert delivery.delivered_at is not None
        assert delivery.last_error == ""
        assert webhooks_deliver_due() == 0

        assert len(hook.requests) == 3
        assert all(request.verified for request in hook.requests)
        first = hook.requests[0]
        assert first.body == orjson.dumps({"id": "batch_1", "status": "completed"})
        assert first.headers["Content-Type"] == "application/json"
        assert first.headers["Webhook-Id"] == f"whd_{delivery.pk}"
        assert first.headers["Webhook-Event"] == "batch.completed"
        assert first.headers["User-Agent"].startswith("inference-platform-webhooks/")
        assert not verify("whsec_other", first.body, first.headers[SIGNATURE_HEADER])

    def test_one_run_sends_each_delivery_once(self, org, receiver, private_allowed):
        hook = receiver(500)
        first = _enqueue(org, hook.url())
        second = _enqueue(org, hook.url())
        assert webhooks_deliver_due() == 2  # retried at once (backoff 0), but by the next run
        assert len(hook.requests) == 2
        assert {r.headers["Webhook-Id"] for r in hook.requests} == {f"whd_{first.pk}", f"whd_{second.pk}"}
        assert webhooks_deliver_due(limit=1) == 1

    def test_it_gives_up_after_the_maximum_attempts(self, org, receiver, private_allowed):
        private_allowed.WEBHOOK_MAX_ATTEMPTS = 4
        hook = receiver(503)
        delivery = _enqueue(org, hook.url())
        for _ in range(4):
            assert webhooks_deliver_due() == 1
        delivery.refresh_from_db()
        assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("failed", 4, 503)
        assert webhooks_deliver_due() == 0
        assert len(hook.requests) == 4

    def test_the_backoff_doubles_up_to_an_hour(self, org, receiver, settings):
        settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True
        settings.WEBHOOK_BACKOFF_SECONDS = 10
        settings.WEBHOOK_MAX_ATTEMPTS = 20
        delivery = _enqueue(org, receiver(500).url())
        for attempts, backoff in [(0, 10), (1, 20), (2, 40), (9, 3600)]:
            WebhookDelivery.objects.filter(pk=delivery.pk).update(attempts=attempts, next_attempt_at=timezone.now())
            before = timezone.now()
            assert webhooks_deliver_due() == 1
            delivery.refresh_from_db()
            assert delivery.attempts == attempts + 1
            waited = delivery.next_attempt_at - before
            assert timedelta(seconds=backoff) <= waited < timedelta(seconds=backoff + 5)

    def test_it_does_not_follow_redirects(self, org, receiver, private_allowed):
        hook = receiver(302)
        delivery = _enqueue(org, hook.url())
        assert webhooks_deliver_due() == 1
        delivery.refresh_from_db()
        assert delivery.status == "pending"
        assert delivery.last_status_code == 302
        assert "redirects are not followed" in delivery.last_error
        assert len(hook.requests) == 1

    def test_a_receiver_that_is_down_is_retried(self, org, private_allowed):
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
        delivery = _enqueue(org, f"http://127.0.0.1:{port}/hook")
        assert webhooks_deliver_due() == 1
        delivery.refresh_from_db()
        assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("pending", 1, None)
        assert delivery.last_error.startswith("could not send: ConnectError")

    def test_an_internal_address_at_send_time_fails_without_a_request(self, org, receiver):
        hook = receiver(200)
        delivery = _enqueue(org, hook.url())
        assert webhooks_deliver_due() == 0
        delivery.refresh_from_db()
        assert delivery.status == "failed"
        assert delivery.last_error == INTERNAL
        assert hook.requests == []

    def test_a_name_that_stops_resolving_is_retried(self, org, dns, private_allowed):
        dns["hooks.example.com"] = []
        delivery = _enqueue(org, "https://hooks.example.com/batch")
        assert webhooks_deliver_due() == 0
        delivery.refresh_from_db()
        assert (delivery.status, delivery.attempts) == ("pending", 1)
        assert "does not resolve" in delivery.last_error

    def test_it_connects_to_the_address_it_checked(self, org, receiver, dns, private_allowed):
        """The name is resolved once, by the check, and the request goes to that address: a
        resolver that answers differently a moment later (DNS rebinding) is never asked."""
        dns["hooks.example.com"] = ["127.0.0.1"]
        hook = receiver(200)
        delivery = _enqueue(org, hook.url("hooks.example.com"))
        assert webhooks_deliver_due() == 1
        delivery.refresh_from_db()
        assert delivery.status == "delivered"
        assert dns["asked"] == ["hooks.example.com"]
        assert hook.requests[0].headers["Host"] == f"hooks.example.com:{hook.port}"

    def test_a_delivery_whose_last_attempt_never_finished_is_given_up(self, org, receiver, private_allowed):
        private_allowed.WEBHOOK_MAX_ATTEMPTS = 3
        hook = receiver(200)
        delivery = _enqueue(org, hook.url())
        WebhookDelivery.objects.filter(pk=delivery.pk).update(attempts=3)  # its worker died mid-send
        assert webhooks_deliver_due() == 0
        delivery.refresh_from_db()
        assert delivery.status == "failed"
        assert "did not finish" in delivery.last_error
        assert hook.requests == []

    def test_a_claimed_delivery_waits_for_its_lease(self, org, receiver, private_allowed):
        hook = receiver(200)
        delivery = _enqueue(org, hook.url())
        leased = timezone.now() + timedelta(seconds=40)
        WebhookDelivery.objects.filter(pk=delivery.pk).update(attempts=1, next_attempt_at=leased)
        assert webhooks_deliver_due() == 0
        assert hook.requests == []

    def test_a_run_is_queued_on_commit_and_a_broker_failure_stays_quiet(
        self, org, monkeypatch, caplog, django_capture_on_commit_callbacks
    ):
        from celery import current_app

        from serving import tasks
        from serving.batches import enqueue

        queued: list[tuple[str, dict[str, Any]]] = []
        monkeypatch.setattr(current_app, "send_task", lambda name, **kwargs: queued.append((name, kwargs)))
        with django_capture_on_commit_callbacks(execute=True):
            delivery = _enqueue(org, "https://hooks.example.com/batch")
        assert queued == [("serving.tasks.webhooks_deliver", {"retry": False})]
        # The names queued are the tasks' own.
        assert (tasks.webhooks_deliver.name, tasks.batch_work.name) == (enqueue.WEBHOOKS_DELIVER, enqueue.BATCH_WORK)
        assert delivery.next_attempt_at <= timezone.now()

        def refuse(name: str, **kwargs: Any) -> None:
            raise ConnectionError("broker down")

        monkeypatch.setattr(current_app, "send_task", refuse)
        with (
            caplog.at_level(logging.WARNING, logger="serving.batches.enqueue"),
            django_capture_on_commit_callbacks(execute=True),
        ):
            _enqueue(org, "https://hooks.example.com/batch")
        assert "beat's next run sends it" in caplog.text
        assert WebhookDelivery.objects.filter(organization=org, status="pending").count() == 2

    def test_the_portal_lists_an_organisations_latest_deliveries(self, org):
        other = organization_create(name="Other Corp")
        mine = [_enqueue(org, f"https://hooks.example.com/{n}") for n in range(3)]
        _enqueue(other, "https://hooks.example.com/other")
        assert [d.pk for d in deliveries_of(org.pk)] == [d.pk for d in reversed(mine)]
        assert [d.pk for d in deliveries_of(org.pk, limit=2)] == [mine[2].pk, mine[1].pk]


# --- The organisation's secret ---------------------------------------------------------


class TestWebhookSecret:
    def test_it_is_made_once_and_stays(self, org):
        assert org.webhook_secret == ""
        secret = organization_webhook_secret(organization_id=org.pk)
        assert secret.startswith("whsec_")
        assert len(secret) > 40
        assert organization_webhook_secret(organization_id=org.pk) == secret
        org.refresh_from_db()
        assert org.webhook_secret == secret

    def test_rotating_replaces_it(self, org):
        first = organization_webhook_secret(organization_id=org.pk)
        rotated = organization_webhook_secret(organization_id=org.pk, rotate=True)
        assert rotated != first
        assert rotated.startswith("whsec_")
        assert organization_webhook_secret(organization_id=org.pk) == rotated

    def test_it_never_replaces_a_stored_secret_unasked(self, org):
        type(org).objects.filter(pk=org.pk).update(webhook_secret="whsec_stored")
        assert organization_webhook_secret(organization_id=org.pk) == "whsec_stored"

    def test_secrets_are_per_organisation(self, org):
        other = organization_create(name="Other Corp")
        assert organization_webhook_secret(organization_id=org.pk) != organization_webhook_secret(
            organization_id=other.pk
        )

    def test_an_unknown_organisation_is_an_error(self, org):
        with pytest.raises(type(org).DoesNotExist):
            organization_webhook_secret(organization_id=org.pk + 10_000)
        with pytest.raises(type(org).DoesNotExist):
            organization_webhook_secret(organization_id=org.pk + 10_000, rotate=True)
