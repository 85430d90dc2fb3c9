"""Request bodies of the OpenAI-compatible API, validated before anything is dispatched."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serving.errors import InvalidRequest

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Stop = str | Annotated[list[str], Field(max_length=4)] | None
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
# Strings, a list of strings, token ids, or a list of token-id lists (OpenAI's four forms).
PromptInput = (
    str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
)


BodyT = TypeVar("BodyT", bound=BaseModel)


class _Body(BaseModel):
    # Unknown arguments are refused, as OpenAI does; types are not coerced ("1" is not 1).
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class _Sampling(_Body):
    model: Annotated[str, Field(min_length=1)]
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    stop: Stop = None
    seed: int | None = None
    user: str | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # vLLM sampling extensions, passed through.
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    top_k: int | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None

    @property
    def wants_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: dict[str, Any] | None = None

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: PromptInput
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], str | list) and len(value) > 1:
            raise ValueError("only one prompt per request is supported (n=1)")
        return value

    @property
    def completion_limit(self) -> int | None:
        return self.max_tokens


class EmbeddingRequest(_Body):
    model: Annotated[str, Field(min_length=1)]
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None


def parse_body(raw: bytes, schema: type[BodyT]) -> tuple[BodyT, dict[str, Any]]:
    """Parse and validate a JSON body; any problem is a 400 with the offending ``param``."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest(
            "We could not parse the JSON body of your request. The body must be valid JSON.",
            code="invalid_json",
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    try:
        return schema.model_validate(data), data
    except ValidationError as exc:
        raise _as_invalid_request(exc) from None


_UNION_HINTS = {
    "input": "expected a non-empty string, array of strings, array of token ids or array of token-id arrays",
    "prompt": "expected a non-empty string, array of strings, array of token ids or array of token-id arrays",
    "stop": "expected a string or an array of at most 4 strings",
}


def _as_invalid_request(exc: ValidationError) -> InvalidRequest:
    errors = exc.errors(include_url=False)
    error = errors[0]
    param = _param(error["loc"])
    if len(errors) > 1 and all(_param(e["loc"]) == param for e in errors) and param in _UNION_HINTS:
        # Every member of a union failed: one message about the accepted shapes.
        return InvalidRequest(f"Invalid value for '{param}': {_UNION_HINTS[param]}.", param=param, code="invalid_value")
    if error["type"] == "extra_forbidden":
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param)
    if error["type"] == "missing":
        return InvalidRequest(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    message = error["msg"].removeprefix("Value error, ")
    return InvalidRequest(f"Invalid value for '{param}': {message}.", param=param, code="invalid_value")


def _param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in {"str", "list[str]", "list[int]", "list[list[int]]"} or "[" in str(part):
            continue  # pydantic's union-member labels, not a real parameter path
        else:
            out += f".{part}" if out else str(part)
    return out
