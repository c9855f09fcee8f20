"""OpenAI request bodies, validated at the edge. Unknown arguments are refused, as
OpenAI does ("Unrecognized request argument supplied"). A chat body is the chat
codec's own (streaming/apis/chat_request.py builds the call's request from it); no
other API validates into it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
)

from sluice.errors import BadRequest
from sluice.schemas import Line
from streaming.pipeline.callrequest import MAX_CHOICES

ConversationId = Annotated[str, StringConstraints(pattern=r"^conv_[0-9a-f]{24}$")]
# A model name: any printable text (OpenAI's and tenants' names vary: "org/model:tag"),
# no control characters (a NUL cannot even be looked up in PostgreSQL).
ModelName = Annotated[Line, StringConstraints(min_length=1, max_length=200)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id... pass through
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class FunctionDef(_Strict):
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    # Agent CLIs describe tools at length (Codex's spawn_agent: 5,989 characters).
    description: Annotated[str, StringConstraints(max_length=32768)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Annotated[str, StringConstraints(max_length=4096)] | None = None
    # "schema" shadows a BaseModel attribute: stored as schema_, read and written as
    # "schema".
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_schema", "json_object"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


# A reasoning model's effort (chat's `reasoning_effort`, Responses' `reasoning.effort`).
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
Verbosity = Literal["low", "medium", "high"]


class ClientHints(_Strict):
    """Parameters of OpenAI's APIs that steer OpenAI's own service and that clients send
    as a matter of course (Codex CLI sends `prompt_cache_key` with every call): accepted
    and checked, without effect here. The engine's prefix cache needs no key, there is
    one service tier (a reply says "default"), and the caller's identity for abuse
    monitoring is the API key's tenant and member."""

    prompt_cache_key: Annotated[str, StringConstraints(max_length=1024)] | None = None
    prompt_cache_retention: Literal["in-memory", "in_memory", "24h"] | None = None
    safety_identifier: Annotated[str, StringConstraints(max_length=256)] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None


class ChatCompletionRequest(ClientHints):
    model: ModelName
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    # Choices, each its own sequence (streaming/pipeline/choices.py).
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = None
    user: Annotated[str, StringConstraints(max_length=256)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    # Token id (as a string, JSON's keys) -> bias; the worker checks the ids against
    # its model's vocabulary.
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    logit_bias: Annotated[dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")],
                               Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=300)] | None = None
    metadata: dict[str, str] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # Hints for reasoning models (none here): accepted without effect.
    reasoning_effort: Effort | None = None
    verbosity: Verbosity | None = None
    # OpenAI keeps a completion for its evals when asked; Sluice keeps none: only "no".
    store: Literal[False] | None = None
    # Sluice extension (also the X-Sluice-Conversation-Id header): server-side history.
    conversation_id: ConversationId | None = None
    # Sluice extension: with conversation_id and stream, resume that conversation's
    # latest stream after this event sequence number (as Last-Event-ID does).
    last_offset: Annotated[int, Field(ge=-1)] | None = None


class EmbeddingRequest(_Strict):
    model: ModelName
    input: str | Annotated[list[str], Field(min_length=1, max_length=2048)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: Annotated[str, StringConstraints(max_length=256)] | None = None


_Model = TypeVar("_Model", bound=BaseModel)


def parse(model: type[_Model], data: Any) -> _Model:
    """`data` as `model`, or OpenAI's 400 naming the first field that is wrong."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError,
                     param_of: Callable[[tuple[Any, ...]], str] | None = None) -> BadRequest:
    """A request body's first validation error as OpenAI words it; `param_of` names the
    field from the error's location (default: its parts joined with dots)."""
    first = exc.errors()[0]
    loc = tuple(first.get("loc", ()))
    param = (param_of(loc) if param_of is not None else ".".join(str(p) for p in loc)) \
        or None
    if first.get("type") == "extra_forbidden":
        return BadRequest(f"Unrecognized request argument supplied: {param}", param=param,
                          code="unknown_parameter")
    if first.get("type") == "missing":
        return BadRequest(f"Missing required parameter: '{param}'.", param=param,
                          code="missing_required_parameter")
    return BadRequest(f"Invalid value for '{param}': {first.get('msg')}", param=param,
                      code="invalid_value")
