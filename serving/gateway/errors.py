"""OpenAI-style errors: the one error shape every data-plane response uses."""

from __future__ import annotations

from typing import Any

import orjson
from django.http import HttpResponse

# A message or param may quote what the client sent (a model name, an argument's name, an
# engine's message about it): no more than this much of it comes back, so a 3 MB model name
# is not answered with a 3 MB error.
MESSAGE_LIMIT = 2000
PARAM_LIMIT = 200


def bounded(text: str, limit: int) -> str:
    """``text``, or its start and end around an ellipsis when it is longer than ``limit``."""
    if len(text) <= limit:
        return text
    half = (limit - 1) // 2
    return text[:half] + "…" + text[len(text) - half :]


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """An error a client sees as ``{"error": {"message", "type", "param", "code"}}``."""

    status = 500
    type = "server_error"
    code: str | None = None
    # For an engine's failure: the replicas the attempt went to (a fallback tries others).
    replicas_tried: tuple[int, ...] = ()

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = bounded(message, MESSAGE_LIMIT)
        super().__init__(message)
        self.message = message
        # An engine's param passes through as it came: only ever a string (or null) here.
        self.param = None if param is None else bounded(str(param), PARAM_LIMIT)
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def detail(self) -> dict[str, Any]:
        """The inside of the body: ``{"message", "type", "param", "code"}``."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def response(self, request_id: str | None = None, *, protocol: bool = False) -> HttpResponse:
        """The error as OpenAI's body, or (``protocol``) as the Open Inference Protocol's
        ``{"error": "<message>"}``, with its status and headers (e.g. Retry-After)."""
        body = {"error": self.message} if protocol else self.body()
        response = HttpResponse(orjson.dumps(body), status=self.status, content_type="application/json")
        for name, value in self.headers.items():
            response[name] = value
        if request_id:
            response["x-request-id"] = request_id
        return response


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"


class AuthenticationFailed(APIError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(APIError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    code = "request_body_too_large"


class RateLimited(APIError):
    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"


class EngineUnavailable(APIError):
    """No replica could take the request (none ready, all refused the connection)."""

    status = 503
    type = "service_unavailable"
    code = "engine_unavailable"


class EngineTimeout(APIError):
    status = 504
    type = "timeout"
    code = "engine_timeout"


class EngineFailed(APIError):
    """The engine broke the request after it was accepted (crash, reset, bad answer)."""

    status = 502
    type = "server_error"
    code = "engine_error"


class ModelNotFound(InvalidRequest):
    """An unknown model name is a bad request (400), like any other invalid parameter."""

    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")
