"""The lean inference routes in the OpenAPI document.

`POST /v1/chat/completions` and `POST /v1/embeddings` are served by the ASGI fast path
(streaming/transports/asgi.py), outside Django Ninja, so Ninja's document does not know them. Their
operations are described here: the request bodies from the same pydantic models that
validate them (streaming/pipeline/schemas.py), the responses from the models below, which state
what streaming/apis/bodies.py builds. tests/resilience/test_api_fuzz.py calls the live server
with generated input against this description, so a drift between the two fails it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from sluice.errors import error_response_doc
from streaming.apis.completions import CompletionRequest, TextCompletion
from streaming.apis.messages.codec import OPENAPI_MODELS as MESSAGES_MODELS
from streaming.apis.messages.codec import openapi_paths as messages_paths
from streaming.apis.responses.codec import ResponsesRequest
from streaming.apis.responses.wire import ResponseObject
from streaming.pipeline.schemas import ChatCompletionRequest, EmbeddingRequest


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"]
    logprobs: None = None


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: CompletionUsage
    conversation_id: str | None = None  # Sluice: the conversation the turn was kept in


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def add_inference_routes(schema: dict[str, Any]) -> None:
    """Add the lean routes' operations and their models to an OpenAPI 3.1 `schema`
    (whose components already hold `Error` and the `BearerAuth` scheme)."""
    _, top = models_json_schema(
        [(ChatCompletionRequest, "validation"), (EmbeddingRequest, "validation"),
         (ChatCompletion, "serialization"), (EmbeddingList, "serialization"),
         (CompletionRequest, "validation"), (TextCompletion, "serialization"),
         (ResponsesRequest, "validation"), (ResponseObject, "serialization"),
         *MESSAGES_MODELS],
        ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in top.get("$defs", {}).items():
        if name in components and components[name] != definition:
            raise RuntimeError(f"OpenAPI component {name!r} is defined twice, differently")
        components[name] = definition
    schema["paths"]["/v1/chat/completions"] = {"post": _operation(
        "chat_completions", "Create a chat completion (OpenAI-compatible)",
        ChatCompletionRequest, ChatCompletion, "The completion, or its stream of chunks",
        description="With `stream: true` the reply is Server-Sent Events: "
                    "`chat.completion.chunk` objects, then `data: [DONE]`.",
        also={"text/event-stream": {"schema": {"type": "string"}}})}
    schema["paths"]["/v1/embeddings"] = {"post": _operation(
        "embeddings", "Create embeddings (OpenAI-compatible)", EmbeddingRequest,
        EmbeddingList, "One vector per input")}
    schema["paths"]["/v1/completions"] = {"post": _operation(
        "completions", "Create a completion (OpenAI's legacy Completions API)",
        CompletionRequest, TextCompletion, "The completion, or its stream of chunks",
        description="With `stream: true` the reply is Server-Sent Events: "
                    "`text_completion` objects, then `data: [DONE]`.",
        # OpenAPI 3.1: an event stream's `schema` describes each event.
        also={"text/event-stream": {"schema": {
            "type": "object", "required": ["data"],
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}})}
    schema["paths"]["/v1/responses"] = {"post": _operation(
        "responses_create", "Create a response (OpenAI's Responses API)", ResponsesRequest,
        ResponseObject, "The response, or its stream of events",
        description="With `stream: true` the reply is Server-Sent Events: "
                    "`response.created` ... `response.completed`, each numbered by "
                    "`sequence_number`.",
        also={"text/event-stream": {"schema": {
            "type": "object", "required": ["data"],
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}})}
    schema["paths"].update(messages_paths())  # Anthropic's shapes, errors included


def _operation(operation_id: str, summary: str, request: type[BaseModel],
               response: type[BaseModel], answered: str, *, description: str = "",
               also: dict[str, Any] | None = None) -> dict[str, Any]:
    """One inference route's POST: the request model in, the response model (and the
    `also` content types) on 200, the error envelope on refusals and retriable 503/504."""
    def ref(model: type[BaseModel]) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    return {
        "operationId": operation_id, "tags": ["inference"], "summary": summary,
        **({"description": description} if description else {}),
        "security": [{"BearerAuth": []}],
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": ref(request)}}},
        "responses": {
            "200": {"description": answered,
                    "content": {"application/json": {"schema": ref(response)},
                                **(also or {})}},
            "4XX": error_response_doc("Refused: an OpenAI-style error envelope (bad input, "
                                      "credentials, role, unknown model, rate limit, "
                                      "quota, overload)."),
            "503": error_response_doc("Overloaded or a dependency is away: retry after "
                                      "Retry-After"),
            "504": error_response_doc("The deadline passed"),
        },
    }
