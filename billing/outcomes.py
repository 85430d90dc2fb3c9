"""How a metered request ended, as its status says: answered, cancelled by its client, or an error.

The one definition behind every count of errors: the rollups' SQL (``billing.rollups``), the
usage readers and pages, the canary's statistics and the deployments table (``rollout``), the
console's live counters. A client's cancel is not the server's error: a request whose client
went away before it finished (status 499, nginx's "client closed request"; ``error_code``
``client_closed``: the playground's Stop, a closed stream or socket) counts in no error rate and
no canary verdict, in neither the numerator nor the denominator; it is shown as its own
outcome. Nothing is known of how it would have ended: it is neither an error nor a success.
"""

from __future__ import annotations

# The status a usage record keeps for a request whose client went away (serving.llm.call
# records it; the gateway's Prometheus counter labels it so).
CLIENT_CLOSED = 499
CLIENT_CLOSED_CODE = "client_closed"

# For a rollup's SQL over usage records (a constant: nothing here comes from a caller).
CANCELLED_SQL = f"status_code = {CLIENT_CLOSED}"
ERROR_SQL = f"status_code NOT BETWEEN 200 AND 299 AND status_code <> {CLIENT_CLOSED}"


def answered(status_code: int) -> bool:
    return 200 <= status_code < 300


def cancelled_by_client(status_code: int) -> bool:
    """The client went away before the request finished: not the server's error."""
    return status_code == CLIENT_CLOSED


def failed(status_code: int) -> bool:
    """An error, of the server or of the request (any status but 2xx), that is not a client's cancel."""
    return not answered(status_code) and not cancelled_by_client(status_code)


def decided(requests: int, cancelled: int) -> int:
    """The requests whose outcome the server decided: every one but those their clients cancelled."""
    return max(requests - cancelled, 0)


def error_rate(*, errors: int, requests: int, cancelled: int) -> float | None:
    """``errors`` over the requests the server decided (cancels in neither side); None when none was."""
    n = decided(requests, cancelled)
    return errors / n if n else None
