"""Request bodies of the OpenAI-compatible API, validated before anything is dispatched.

Every field of OpenAI's chat/completions/embeddings schemas is accepted. Each one is
either forwarded to the engine (vLLM supports it), dropped because it changes nothing
here (``metadata``, ``store`` …; listed in ``DROPPED``), or refused with a 400 that names
it because the platform cannot do it (``audio``, ``web_search_options`` …; ``REFUSED``).
A curated set of vLLM's own sampling extensions is forwarded too; vLLM's internal or
operator-only fields (``chat_template``, ``priority``, ``request_id`` …) are refused.
Anything else is an unrecognized argument, as OpenAI answers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serving.gateway.errors import InvalidRequest

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Stop = str | Annotated[list[str], Field(max_length=4)] | None
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
# Strings, a list of strings, token ids, or a list of token-id lists (OpenAI's four forms).
PromptInput = (
    str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
)
# OpenAI allows up to 128 choices; an engine on one core makes more than a few pointless.
MAX_CHOICES = 16

BodyT = TypeVar("BodyT", bound=BaseModel)


class _Body(BaseModel):
    # Unknown arguments are refused, as OpenAI does; types are not coerced ("1" is not 1).
    model_config = ConfigDict(extra="forbid", strict=True)


class _Loose(BaseModel):
    # Nested objects whose inner fields the engine validates (tools, response formats …).
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of SSE chunks: nothing to pad here


class ContentPart(_Loose):
    type: str
    text: str | None = None


class FunctionCall(_Loose):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(_Loose):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ResponseFormat(_Loose):
    """``{"type": "json_schema", …}`` and the like: the engine checks the inside."""


class ChatMessage(_Loose):
    """Every message shape OpenAI clients send: content as text, parts or null, tool calls, tool results."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None


class Tool(_Loose):
    type: str
    function: dict[str, Any] | None = None


class _Sampling(_Body):
    model: Annotated[str, Field(min_length=1)]
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    stop: Stop = None
    seed: int | None = None
    user: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # Accepted; nothing here depends on them (see DROPPED).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM sampling extensions, forwarded.
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    top_k: int | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    length_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    structured_outputs: dict[str, Any] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    add_special_tokens: bool | None = None
    cache_salt: str | None = None
    use_beam_search: bool | None = None

    @property
    def wants_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # vLLM chat extensions, forwarded (the prompt counter renders them like the engine does).
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool | None = None
    thinking_token_budget: int | None = None
    # The gateway's own: false keeps this request out of the semantic cache (never forwarded).
    cache: bool | None = None

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and set(value) - {"text"}:
            raise ValueError("only text output is supported")
        return value

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: PromptInput
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("insertion (a non-empty suffix) is not supported by these models")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise ValueError("best_of > 1 is not supported; request n choices instead")
        return value

    @property
    def completion_limit(self) -> int | None:
        return self.max_tokens

    @property
    def prompt_count(self) -> int:
        """How many prompts the request carries (a list of strings or of token-id lists)."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            return len(self.prompt)
        return 1


class EmbeddingRequest(_Body):
    model: Annotated[str, Field(min_length=1)]
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # vLLM extensions, forwarded.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    add_special_tokens: bool | None = None
    # The gateway's own: false keeps this request out of the embeddings cache (never forwarded).
    cache: bool | None = None


# Accepted and not forwarded: they change nothing about the answer on this platform.
DROPPED = frozenset(
    {"metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "cache"}
)

# OpenAI fields the platform cannot honour, and vLLM fields a tenant may not set.
REFUSED = {
    "audio": "audio output is not supported by these models",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not available on this platform",
    "functions": "'functions' is deprecated and not supported; use 'tools'",
    "function_call": "'function_call' is deprecated and not supported; use 'tool_choice'",
    "verbosity": "'verbosity' is not supported by these models",
    "chat_template": "a custom chat template cannot be set per request",
    "request_id": "request ids are assigned by the platform (see the x-request-id header)",
    "priority": "scheduling priority is set by the platform",
    "kv_transfer_params": "an engine-internal parameter",
    "ec_transfer_params": "an engine-internal parameter",
    "vllm_xargs": "an engine-internal parameter",
    "mm_processor_kwargs": "an engine-internal parameter",
    "media_io_kwargs": "an engine-internal parameter",
    "mm_payload": "an engine-internal parameter",
    "return_mm_kwargs": "an engine-internal parameter",
    "session_id": "an engine-internal parameter",
    "routed_experts_prompt_start": "an engine-internal parameter",
    "prompt_embeds": "prompt embeddings are not accepted",
}


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
    for name, reason in REFUSED.items():
        if name in data and data[name] is not None:
            raise InvalidRequest(
                f"Unsupported parameter: '{name}': {reason}.", param=name, code="unsupported_parameter"
            )
    try:
        return schema.model_validate(data), data
    except ValidationError as exc:
        raise _as_invalid_request(exc) from None


def engine_payload(data: dict[str, Any]) -> dict[str, Any]:
    """The body to forward: what the client sent, less what is dropped or set by the gateway."""
    return {name: value for name, value in data.items() if name not in DROPPED and value is not None}


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
        elif part in {"str", "list[str]", "list[int]", "list[list[int]]", "list[ContentPart]"} or "[" in str(part):
            continue  # pydantic's union-member labels, not a real parameter path
        else:
            out += f".{part}" if out else str(part)
    return out
