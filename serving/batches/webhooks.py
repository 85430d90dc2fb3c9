"""Webhooks to customers' addresses (batch jobs' ``callback_url``): which addresses they may go
to, their signature, and their delivery with retries and backoff (docs/webhooks.md)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import unquote

import httpx
import orjson
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from accounts.services import organization_webhook_secret
from serving.batches import enqueue
from serving.batches.models import WebhookDelivery

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "Webhook-Signature"
ID_HEADER = "Webhook-Id"
EVENT_HEADER = "Webhook-Event"
USER_AGENT = "inference-platform-webhooks/1"
URL_MAX_LENGTH = 2000
BACKOFF_MAX_SECONDS = 3600
# A claimed delivery is left alone this long beyond the send's timeout before another run may
# take it again (its worker having died mid-send): the lease that stands in for a row lock,
# which is never held across the HTTP call.
_LEASE_MARGIN_SECONDS = 30
# How much of a refusing receiver's answer last_error keeps, to say why.
_ANSWER_EXCERPT_BYTES = 200
_LAST_ERROR_MAX_LENGTH = 500  # WebhookDelivery.last_error


# --- Signatures ------------------------------------------------------------------------


def _digest(secret: str, body: bytes, timestamp: int) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, *, timestamp: int) -> str:
    """The Webhook-Signature header of ``body`` sent at ``timestamp`` (Unix seconds):
    ``t=<timestamp>,v1=<hex HMAC-SHA256, keyed with secret, of "<timestamp>." + body>``.

    The timestamp is signed with the body so that a captured request cannot be replayed
    later: ``verify`` refuses one outside its tolerance.
    """
    return f"t={timestamp},v1={_digest(secret, body, timestamp)}"


def verify(secret: str, body: bytes, header: str, *, tolerance: int = 300, now: float | None = None) -> bool:
    """Whether ``header`` signs ``body`` with ``secret``, at a time within ``tolerance`` seconds
    of ``now`` (either side: a receiver's clock may be behind).

    The header may carry several ``v1=`` values (signed with an old and a new secret while a
    rotation settles); one matching is enough. Compared in constant time.
    """
    timestamps: list[str] = []
    signatures: list[bytes] = []
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t":
            timestamps.append(value)
        elif key == "v1":
            signatures.append(value.encode())
    if len(timestamps) != 1 or not timestamps[0].isdigit() or not signatures:
        return False
    timestamp = int(timestamps[0])
    if abs((time.time() if now is None else now) - timestamp) > tolerance:
        return False
    expected = _digest(secret, body, timestamp).encode()
    # Every value is compared, not only those up to the first match.
    matches = [hmac.compare_digest(expected, signature) for signature in signatures]
    return any(matches)


# --- Where webhooks may go -------------------------------------------------------------


class BadCallback(ValueError):
    """A callback URL that webhooks may not go to; ``message`` says why, in one sentence."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UnresolvedCallback(BadCallback):
    """A callback URL whose host does not resolve: refused when a customer gives it, but only
    retried when sending, since a resolver fails for a while and then answers again."""


@dataclass(frozen=True)
class _Target:
    """A checked callback URL and the addresses to connect to: those checked, so that the host
    cannot resolve to an internal one in between (DNS rebinding). None: connect by name."""

    url: httpx.URL
    addresses: tuple[str, ...] | None


# Not globally reachable, from IANA's special-purpose address registries, named here so that the
# check does not change with the Python release (ipaddress's own lists grew in 3.12.4 and 3.13):
# 6to4, Teredo and the local-use NAT64 prefix are refused whatever they wrap, as current Pythons do.
_NOT_GLOBAL_V4 = tuple(ipaddress.IPv4Network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15",
    "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
))  # fmt: skip
_NOT_GLOBAL_V6 = {
    ipaddress.IPv6Network(network): name
    for network, name in (
        ("::/8", ""), ("64:ff9b:1::/48", "local-use NAT64"), ("100::/64", ""), ("2001::/32", "Teredo"),
        ("2001::/23", ""), ("2001:db8::/32", ""), ("2002::/16", "6to4"), ("3fff::/20", ""), ("5f00::/16", ""),
        ("fc00::/7", ""), ("fe80::/10", ""), ("fec0::/10", ""), ("ff00::/8", ""),
    )
}  # fmt: skip
# IPv6 addresses that only translate the IPv4 address in their last 32 bits: a packet to one
# reaches that IPv4 address (the host's own stack; a NAT64 gateway, RFC 6052), so it is judged
# by that address alone. A public host reached through DNS64 resolves into 64:ff9b::/96.
_IPV4_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215; the /96 layout is the usual one
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated (RFC 4291)
_IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")  # SIIT (RFC 2765)
_LOW_32 = 0xFFFF_FFFF


def _wrapped_ipv4(ip: ipaddress.IPv6Address) -> list[tuple[str, ipaddress.IPv4Address]]:
    """The IPv4 addresses that ``ip`` carries, each with how: every form that embeds one."""
    low = ipaddress.IPv4Address(int(ip) & _LOW_32)
    wrapped: list[tuple[str, ipaddress.IPv4Address]] = []
    if ip in _IPV4_MAPPED:
        wrapped.append(("the IPv4-mapped form of", low))
    elif ip in _IPV4_TRANSLATED:
        wrapped.append(("the IPv4-translated form of", low))
    elif ip in _NAT64 or ip in _NAT64_LOCAL:
        wrapped.append(("the NAT64 form of", low))
    elif ip in _IPV4_COMPATIBLE and int(ip) > 1:  # not :: or ::1
        wrapped.append(("the IPv4-compatible form of", low))
    if ip.sixtofour is not None:
        wrapped.append(("the 6to4 form of", ip.sixtofour))
    if ip.teredo is not None:  # (server, client), the client's bits un-inverted
        wrapped += [("a Teredo address of server", ip.teredo[0]), ("a Teredo address of client", ip.teredo[1])]
    # ISATAP (RFC 5214): an interface id of 0000:5efe, or with the u/l and group bits set (0200:5efe), and
    # the IPv4 address, under any /64 prefix, public ones included.
    if (int(ip) >> 32) & 0xFCFF_FFFF == 0x0000_5EFE:
        wrapped.append(("the ISATAP form of", low))
    return wrapped


def _is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """``not is_global`` adds what the named flags miss, such as carrier-grade NAT (100.64.0.0/10),
    often a cloud's internal network; the tables, what this Python's lists may not have."""
    if (
        ip.is_loopback
        or ip.is_private
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or not ip.is_global
    ):
        return False
    if isinstance(ip, ipaddress.IPv4Address):
        return not any(ip in network for network in _NOT_GLOBAL_V4)
    return not ip.is_site_local and not any(ip in network for network in _NOT_GLOBAL_V6)


def _internal_address(address: str) -> str | None:
    """Why webhooks may not go to ``address`` (an IP address; an IPv6 zone is ignored), in a
    few words (*an internal address (the 6to4 form of 127.0.0.1)*), or None when it is public.

    The one judge of every address, written in the URL or resolved from its host. An IPv6
    address that carries an IPv4 one is refused when either is internal, naming the IPv4
    address; one that only translates it (IPv4-mapped, NAT64's well-known prefix) is as public
    as the IPv4 address it reaches.
    """
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return "not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        for how, ipv4 in _wrapped_ipv4(ip):
            if not _is_public(ipv4):
                return f"an internal address ({how} {ipv4})"
        if ip in _IPV4_MAPPED or ip in _NAT64:
            return None
        if not _is_public(ip):
            named = [(network, name) for network, name in _NOT_GLOBAL_V6.items() if name and ip in network]
            if named:
                return f"an internal address ({named[0][1]}: {named[0][0]} is not globally routable)"
            return "an internal address"
        return None
    return None if _is_public(ip) else "an internal address"


def _ip_literal(host: str) -> tuple[str, str] | None:
    """``host`` as an IP address written in the URL (IPv6 without brackets) and its IPv6 zone
    ("" for none): what webhooks would connect to without asking a resolver. None for a name,
    and for the numbers only a resolver reads as an address (``2130706433``, ``0x7f.1``,
    ``127.1``): those are judged by what the resolver makes of them, and connected to as such."""
    address, _, zone = host.partition("%") if ":" in host else (host, "", "")
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return None
    return address, zone


def _target(url: str) -> _Target:
    if len(url) > URL_MAX_LENGTH:
        raise BadCallback(f"callback_url must be at most {URL_MAX_LENGTH} characters")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        raise BadCallback("callback_url is not a valid URL") from None
    # httpx lower-cases the scheme and the host, and reads the host after any userinfo
    # ("http://public.example@127.0.0.1/" is 127.0.0.1): what is checked is what is reached.
    if parsed.scheme not in ("http", "https"):
        raise BadCallback("callback_url must be an http or https URL")
    host = parsed.raw_host.decode("ascii")
    if not host:
        raise BadCallback("callback_url must name a host")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise BadCallback("callback_url's port must be between 1 and 65535")
    allowed = {name.lower().rstrip(".") for name in settings.WEBHOOK_ALLOWED_HOSTS}
    if host.lower().rstrip(".") in allowed:
        return _Target(parsed, None)
    literal = _ip_literal(host)
    if literal is not None:
        addresses: tuple[str, ...] = (literal[0],)
    else:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise UnresolvedCallback(f"callback_url's host {host} does not resolve") from None
        # Without an IPv6 scope ("%eth0"): a scoped address is link-local, refused anyway.
        addresses = tuple(dict.fromkeys(str(info[4][0]).partition("%")[0] for info in found))
        if not addresses:
            raise UnresolvedCallback(f"callback_url's host {host} does not resolve")
    if not settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES:
        for address in addresses:
            why = _internal_address(address)
            if why is not None:
                raise BadCallback(
                    f"callback_url resolves to {address}, {why}; the operator has not allowed webhooks to "
                    "internal addresses (WEBHOOK_ALLOW_PRIVATE_ADDRESSES)"
                )
    if literal is not None and literal[1]:
        raise BadCallback(
            f"callback_url's host names an IPv6 zone (%{unquote(literal[1])}), which only a link-local address has; "
            "webhooks cannot be sent to one"
        )
    return _Target(parsed, None if literal is not None else addresses)


def check_callback_url(url: str) -> str:
    """``url`` if webhooks may go there; BadCallback saying why not.

    An http or https URL with a host and a port from 1 to 65535, at most 2,000 characters,
    whose host resolves, every address of it public, and every IPv4 address such an address
    carries (IPv4-mapped, NAT64, 6to4, Teredo, ISATAP, IPv4-compatible; docs/webhooks.md lists
    them): a webhook is sent from inside the platform, and must not reach its internal
    services (cloud metadata, databases, admin ports) for whoever chose the URL.
    Operators allow chosen names whatever they resolve to (WEBHOOK_ALLOWED_HOSTS, not resolved
    here) or every address (WEBHOOK_ALLOW_PRIVATE_ADDRESSES). Blocking (it resolves the host):
    call it from sync code. Sending checks again, and connects only to the addresses it checked.
    """
    _target(url)
    return url


# --- Delivery --------------------------------------------------------------------------


def webhook_enqueue(
    *, organization_id: int, url: str, event: str, payload: dict[str, Any], batch_id: int | None = None
) -> WebhookDelivery:
    """Queue ``payload`` (the request's JSON body) as ``event`` to ``url``, signed with the
    organisation's secret and retried until delivered or given up (``webhooks_deliver_due``).

    ``url`` was checked when the customer gave it (``check_callback_url``); it is checked
    again at each send. A delivery run is queued when the caller's transaction commits, and
    the beat starts one every few seconds anyway, so a broker that refuses the message only
    delays the webhook.
    """
    delivery = WebhookDelivery.objects.create(
        organization_id=organization_id,
        batch_id=batch_id,
        url=url,
        event=event,
        payload=payload,
        status=WebhookDelivery.Status.PENDING,
        next_attempt_at=timezone.now(),
    )
    transaction.on_commit(_queue_delivery_run, robust=True)
    return delivery


def _queue_delivery_run() -> None:
    # No publish retries: the caller would wait on them, and the beat is the retry.
    enqueue.queue(enqueue.WEBHOOKS_DELIVER, retry=False)


def _claim(*, due_by: datetime) -> WebhookDelivery | None:
    """The next delivery due by ``due_by``, its attempt counted and leased to this run.

    Counted before it is made, so that a worker dying mid-send still uses up an attempt and a
    receiver that hangs its worker is given up like any other. One whose last attempt never
    finished is marked failed here rather than sent again.
    """
    lease = timedelta(seconds=settings.WEBHOOK_TIMEOUT + _LEASE_MARGIN_SECONDS)
    while True:
        with transaction.atomic():
            delivery = (
                WebhookDelivery.objects.select_for_update(skip_locked=True)
                .filter(status=WebhookDelivery.Status.PENDING, next_attempt_at__lte=due_by)
                .order_by("next_attempt_at", "pk")
                .first()
            )
            if delivery is None:
                return None
            if delivery.attempts >= settings.WEBHOOK_MAX_ATTEMPTS:
                delivery.status = WebhookDelivery.Status.FAILED
                delivery.last_error = f"gave up after {delivery.attempts} attempts (the last did not finish)"
                delivery.save(update_fields=["status", "last_error"])
                continue
            delivery.attempts += 1
            delivery.next_attempt_at = timezone.now() + lease
            delivery.save(update_fields=["attempts", "next_attempt_at"])
            return delivery


def _settle(delivery: WebhookDelivery, **changes: Any) -> None:
    """Write an attempt's outcome, unless another run took the delivery since (its lease ran
    out): then that run's attempt is the one to record."""
    WebhookDelivery.objects.filter(
        pk=delivery.pk, status=WebhookDelivery.Status.PENDING, attempts=delivery.attempts
    ).update(**changes)
    for name, value in changes.items():
        setattr(delivery, name, value)


def _settle_failure(delivery: WebhookDelivery, *, status_code: int | None, error: str) -> None:
    """A failed attempt: retried after a backoff that doubles each time (capped at an hour),
    until WEBHOOK_MAX_ATTEMPTS have been made."""
    error = error[:_LAST_ERROR_MAX_LENGTH]
    if delivery.attempts >= settings.WEBHOOK_MAX_ATTEMPTS:
        logger.warning("webhook whd_%s gave up after %s attempts: %s", delivery.pk, delivery.attempts, error)
        _settle(delivery, status=WebhookDelivery.Status.FAILED, last_status_code=status_code, last_error=error)
        return
    delay = min(BACKOFF_MAX_SECONDS, settings.WEBHOOK_BACKOFF_SECONDS * 2 ** (delivery.attempts - 1))
    _settle(
        delivery,
        next_attempt_at=timezone.now() + timedelta(seconds=delay),
        last_status_code=status_code,
        last_error=error,
    )


def _answer_excerpt(response: httpx.Response) -> str:
    excerpt = bytearray()
    try:
        for chunk in response.iter_bytes():
            excerpt += chunk
            if len(excerpt) >= _ANSWER_EXCERPT_BYTES:
                break
    except httpx.HTTPError:
        pass  # the status is the answer; its body only illustrates it
    return " ".join(excerpt[:_ANSWER_EXCERPT_BYTES].decode("utf-8", "replace").split())


def _post(target: _Target, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    """POST ``body`` to the target; its status and, unless 2xx, the start of its answer.

    A fresh client each time, without keep-alive across deliveries: a connection made to
    one host's address with its TLS name must never carry another host's request. The
    environment's proxies are ignored (trust_env): through one, the addresses checked
    would not be the ones reached.
    """
    url = target.url
    host = url.raw_host.decode("ascii")
    tries: list[tuple[httpx.URL, dict[str, Any]]] = [(url, {})]
    if target.addresses is not None:
        # Connect to the checked addresses, in the resolver's order; the request still names
        # the host (Host header) and TLS still checks its certificate (SNI).
        tries = [(url.copy_with(host=address), {"sni_hostname": host}) for address in target.addresses]
    headers = {**headers, "Host": url.netloc.decode("ascii")}
    for index, (address_url, extensions) in enumerate(tries):
        try:
            with (
                httpx.Client(timeout=settings.WEBHOOK_TIMEOUT, follow_redirects=False, trust_env=False) as client,
                client.stream("POST", address_url, content=body, headers=headers, extensions=extensions) as response,
            ):
                if response.is_success:
                    return response.status_code, ""
                return response.status_code, _answer_excerpt(response)
        except httpx.ConnectError:
            if index == len(tries) - 1:
                raise
    raise AssertionError("unreachable: the last try returns or raises")


def _attempt(delivery: WebhookDelivery) -> bool:
    """One attempt of a claimed delivery, its outcome written; whether a request was sent."""
    try:
        target = _target(delivery.url)
    except UnresolvedCallback as exc:
        _settle_failure(delivery, status_code=None, error=exc.message)
        return False
    except BadCallback as exc:
        # The address is refused however often it is tried: given up at once.
        logger.warning("webhook whd_%s refused: %s", delivery.pk, exc.message)
        _settle(delivery, status=WebhookDelivery.Status.FAILED, last_status_code=None, last_error=exc.message)
        return False
    body = orjson.dumps(delivery.payload)
    secret = organization_webhook_secret(organization_id=delivery.organization_id)
    headers = {
        "Content-Type": "application/json",
        SIGNATURE_HEADER: sign(secret, body, timestamp=int(time.time())),
        ID_HEADER: f"whd_{delivery.pk}",
        EVENT_HEADER: delivery.event,
        "User-Agent": USER_AGENT,
    }
    try:
        status_code, answer = _post(target, body, headers)
    except httpx.TimeoutException as exc:
        _settle_failure(delivery, status_code=None, error=f"no answer within {settings.WEBHOOK_TIMEOUT:g} s ({exc!r})")
        return True
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        _settle_failure(delivery, status_code=None, error=f"could not send: {exc!r}")
        return True
    if 200 <= status_code < 300:
        _settle(
            delivery,
            status=WebhookDelivery.Status.DELIVERED,
            delivered_at=timezone.now(),
            last_status_code=status_code,
            last_error="",
        )
        return True
    error = f"the receiver answered {status_code}"
    if 300 <= status_code < 400:
        error += " (redirects are not followed)"
    _settle_failure(delivery, status_code=status_code, error=f"{error}: {answer}" if answer else error)
    return True


def webhooks_deliver_due(*, limit: int = 50, budget_seconds: float = 240.0) -> int:
    """Send the pending deliveries that were due when the run began, each at most once, at most
    ``limit``; how many were sent (whatever the answer). Runs every few seconds (the beat).

    Each is claimed in a short transaction (skip_locked: concurrent runs take different ones)
    that counts its attempt and leases it for the send's timeout and a margin; the request is
    made outside any transaction and its outcome written after. 2xx delivers; anything else
    (another status, no connection, no answer in WEBHOOK_TIMEOUT) is retried after
    WEBHOOK_BACKOFF_SECONDS, doubling each time up to an hour, until WEBHOOK_MAX_ATTEMPTS have
    been made; an address refused at send time (check_callback_url) fails at once. A worker
    that dies mid-send leaves the delivery to be sent again after the lease: delivery is at
    least once, and receivers drop repeats by Webhook-Id.

    No new delivery is taken after ``budget_seconds``, so that the task's time limit (300 s)
    does not cut one off mid-send.
    """
    due_by = timezone.now()
    started = time.monotonic()
    sent = 0
    for _ in range(limit):
        if time.monotonic() - started > budget_seconds:
            break
        delivery = _claim(due_by=due_by)
        if delivery is None:
            break
        sent += _attempt(delivery)
    return sent


def deliveries_of(organization_id: int, *, limit: int = 20) -> list[WebhookDelivery]:
    """The organisation's latest webhooks, newest first: what the portal shows of each
    (event, address, status, attempts, last answer or error)."""
    return list(WebhookDelivery.objects.filter(organization_id=organization_id).order_by("-created_at", "-pk")[:limit])
