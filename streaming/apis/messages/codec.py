"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`,
a codec over the gateway's chat call.

The request (validated here, so a 400 names Anthropic's field, in Anthropic's words)
becomes the call's request (streaming/pipeline/callrequest.py): `system` a system message; text
blocks the message's text; an assistant's `tool_use` blocks its `tool_calls` and a
user's `tool_result` blocks `tool` messages, which the gateway writes for the model as
it writes chat's (streaming/pipeline/prompting.py `rendered`); `tools` functions with
`input_schema` as parameters;
`tool_choice` auto / any (required) / tool (named) / none, with
`disable_parallel_tool_use`; `output_config.format` (a JSON schema) the response format;
`stop_sequences` stop; `metadata.user_id` the user; a tool with `defer_loading` is
left out until a tool search loads it (`offered`); a `role: "system"` message in
`messages` (Anthropic's beta) a system message in its place, dropped once a later user
turn exists when its `clear_at` is `next_user_message`. What the engine cannot do is refused
by name (`top_k`, image and document blocks); server tools (`web_search_20250305`,
`code_execution_*`, `bash_*`, `text_editor_*`, `computer_*`) are dropped or refused
by the tenant's hosted tool policy (streaming/apis/hosted.py); `cache_control` hints, `thinking`,
`output_config.effort` (also a system message's), `service_tier` and what Claude
Code sends besides (`context_management`, `betas`, `diagnostics`, any `anthropic-beta`
header) are accepted without effect (no prompt
cache, no model that thinks, no server-side context editing, one tier, one effort
here); an earlier reply's thinking blocks and a tool result's `tool_reference` blocks
are left out of the prompt.

Authentication: `x-api-key` (Anthropic's header) or `Authorization: Bearer`; any
`anthropic-version` is accepted. Every error, also those raised before `serve` runs
(authentication, body limits), is Anthropic's envelope (messages_stream.error_body).

count_tokens answers the prompt's exact token count as the deployment's worker counts
it (its own tokenizer and chat template, the tool prompt included): a `count_only` job
on the model's queue, which the worker answers after encoding, without a forward pass.
The gateway has no tokenizer (no torch, and a deployment's weights may live on other
hosts), and `prompt_bound` is an upper bound, not a count. A count is rate-limited,
audited and free: no tokens are charged.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
)

from inference.jobs import Message, MessageToolCall, ToolSpec
from sluice.errors import ApiError, BadRequest
from sluice.schemas import Line
from streaming.apis import Api, Context, hosted, register
from streaming.apis.httpio import send_json
from streaming.apis.messages import stream as encode
from streaming.pipeline.callrequest import CallRequest, Params, args, json_schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


CacheControl = dict[str, Any] | None  # a prompt-caching hint: accepted, ignored


class AnthropicTextBlockParam(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[dict[str, Any]] | None = None


class AnthropicToolUseBlockParam(_Strict):
    type: Literal["tool_use"]
    id: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,256}$")]
    name: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    input: dict[str, Any]
    cache_control: CacheControl = None
    # What the SDKs echo back from a reply's block (its calling context): no effect here.
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class AnthropicToolReferenceBlockParam(BaseModel):
    """A tool found by a tool search, in a tool result (Claude Code sends them): no
    text for the model; it loads the deferred tool it names (`offered`)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_reference"]
    tool_name: Annotated[str, StringConstraints(max_length=128)] | None = None


ToolResultBlock = Annotated[AnthropicTextBlockParam | AnthropicToolReferenceBlockParam,
                            Field(discriminator="type")]


class AnthropicToolResultBlockParam(_Strict):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,256}$")]
    content: str | list[ToolResultBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None
    toolset_name: str | None = None


class AnthropicThinkingBlockParam(_Strict):
    """An earlier reply's thinking, as a client sends its history back (one that began
    with a model that thinks): left out of the prompt, as Anthropic leaves earlier
    turns' thinking out of the context."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None  # redacted_thinking's
    cache_control: CacheControl = None


ContentBlock = Annotated[
    AnthropicTextBlockParam | AnthropicToolUseBlockParam | AnthropicToolResultBlockParam
    | AnthropicThinkingBlockParam, Field(discriminator="type")]


class AnthropicSystemOutputConfig(_Strict):
    """A system message's per-turn output settings (Anthropic's beta
    `BetaSystemMessageOutputConfig`; `format` stays top-level only): no effect here."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class AnthropicMessageParam(_Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]
    # Only on a `role: "system"` message (checked in `_chat_messages`).
    output_config: AnthropicSystemOutputConfig | None = None
    clear_at: Literal["next_user_message", "never"] | None = None


class AnthropicTool(_Strict):
    type: Literal["custom"] | None = None
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Annotated[str, StringConstraints(max_length=65536)] | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    cache_control: CacheControl = None
    # Hints for Anthropic's own models and streaming: accepted, without effect here.
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    # A deferred tool is not offered to the model until a tool search loads it: a
    # `tool_reference` block naming it, or an earlier call of it (`offered`).
    defer_loading: bool | None = None


# The tool types served here (a tool without a type is custom too); any other, such
# as Anthropic's server tools, is a hosted tool (streaming/apis/hosted.py).
OWN_TOOLS = frozenset({"custom"})


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicMetadata(_Strict):
    user_id: Annotated[str, StringConstraints(max_length=256)] | None = None


class AnthropicJsonFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(_Strict):
    format: AnthropicJsonFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # no effect


class AnthropicThinking(BaseModel):
    """Extended or adaptive thinking. No model here thinks: accepted without effect (a
    reply has no thinking blocks): recent Claude Code versions send adaptive thinking
    by default, whatever the model. Fields Anthropic may add to this hint are ignored."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled", "adaptive"] | None = None
    budget_tokens: Annotated[int, Field(ge=0, le=10_000_000)] | None = None


class AnthropicCountTokensRequest(_Strict):
    model: Annotated[Line, StringConstraints(min_length=1, max_length=200)]
    messages: Annotated[list[AnthropicMessageParam], Field(min_length=1, max_length=4096)]
    system: str | list[AnthropicTextBlockParam] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=128)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    output_config: AnthropicOutputConfig | None = None
    cache_control: CacheControl = None
    thinking: AnthropicThinking | None = None
    # What Claude Code sends besides: server-side context editing (none here: a prompt
    # over the model's context is a 400), beta names, its diagnostics. No effect.
    context_management: dict[str, Any] | None = None
    betas: Annotated[list[Annotated[str, StringConstraints(max_length=128)]],
                     Field(max_length=64)] | None = None
    diagnostics: dict[str, Any] | None = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # refused: no top-k sampling here
    metadata: AnthropicMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier: ignored


_Request = TypeVar("_Request", bound=AnthropicCountTokensRequest)


def parse(model: type[_Request], data: dict[str, Any]) -> _Request:
    """`data` as `model`, or a 400 naming the field as Anthropic does ("max_tokens:
    Field required")."""
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        # A union reports every branch; the deepest error is the one that explains.
        first = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
        where = ".".join(str(p) for p in first.get("loc", ())
                         if not (isinstance(p, str) and ("[" in p or p == "str")))
        raise BadRequest(f"{where}: {first.get('msg')}", param=where or None,
                         code="invalid_request") from None
    if getattr(req, "top_k", None) is not None:
        raise BadRequest("top_k: not supported by this server; use temperature or top_p.",
                         param="top_k", code="unsupported_parameter")
    return req


async def parse_hosted(model: type[_Request], ctx: Context) -> _Request:
    """`parse` of the request's body after its server tools (any tool whose type is
    not a custom tool's) met the tenant's hosted tool policy (streaming/apis/hosted.py):
    dropped, or a 400 naming the first."""
    data, tools = await hosted.applied(ctx, OWN_TOOLS, dotted=True)
    try:
        return parse(model, data)
    except ApiError as exc:
        raise tools.renumbered(exc) from None


def _text(content: str | list[AnthropicTextBlockParam] | list[ToolResultBlock] | None
          ) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(block.text for block in content
                     if isinstance(block, AnthropicTextBlockParam))


def _chat_messages(req: AnthropicCountTokensRequest) -> list[Message]:
    """The conversation as the call's messages: tool_use blocks as an assistant's
    tool_calls, tool_result blocks as tool messages (in their place among the user's
    text)."""
    out: list[Message] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    last_user = max((i for i, m in enumerate(req.messages) if m.role == "user"), default=-1)
    for i, message in enumerate(req.messages):
        if message.role != "system":
            for name in ("output_config", "clear_at"):
                if getattr(message, name) is not None:
                    where = f"messages.{i}.{name}"
                    raise BadRequest(f"{where}: only permitted on system messages.",
                                     param=where, code="invalid_request")
        elif message.clear_at == "next_user_message" and i < last_user:
            continue  # shown only for the user turn it follows, and a later one exists
        blocks = ([AnthropicTextBlockParam(type="text", text=message.content)]
                  if isinstance(message.content, str) else message.content)
        text: list[str] = []
        calls: list[MessageToolCall] = []
        for j, block in enumerate(blocks):
            if isinstance(block, AnthropicTextBlockParam):
                text.append(block.text)
            elif message.role == "assistant" and isinstance(block, AnthropicThinkingBlockParam):
                continue
            elif message.role == "assistant" and isinstance(block, AnthropicToolUseBlockParam):
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input)}})
            elif message.role == "user" and isinstance(block, AnthropicToolResultBlockParam):
                if text:
                    out.append({"role": "user", "content": "\n".join(text)})
                    text = []
                result = _text(block.content)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {result}" if block.is_error else result})
            else:
                where = f"messages.{i}.content.{j}"
                raise BadRequest(f"{where}: {block.type} blocks belong in "
                                 f"{'user' if block.type == 'tool_result' else 'assistant'} "
                                 "messages.", param=where, code="invalid_request")
        if text or calls or not blocks:
            joined: Message = {"role": message.role, "content": "\n".join(text)}
            if calls:
                joined["tool_calls"] = calls
            out.append(joined)
    return out


def offered(req: AnthropicCountTokensRequest) -> list[AnthropicTool]:
    """The tools the model is offered: every tool but a deferred one (`defer_loading`)
    that no tool search has loaded yet. As Anthropic's API does, a deferred tool is
    loaded by a `tool_reference` block naming it in a tool result; an earlier call of
    it (a `tool_use` block) keeps it loaded."""
    loaded: set[str] = set()
    for message in req.messages:
        for block in message.content if isinstance(message.content, list) else ():
            if isinstance(block, AnthropicToolUseBlockParam):
                loaded.add(block.name)
            elif isinstance(block, AnthropicToolResultBlockParam) and isinstance(
                    block.content, list):
                loaded.update(b.tool_name for b in block.content
                              if isinstance(b, AnthropicToolReferenceBlockParam)
                              and b.tool_name)
    return [t for t in req.tools or () if not t.defer_loading or t.name in loaded]


def call_request(req: AnthropicCountTokensRequest, *,
                 idempotency_key: str | None = None) -> CallRequest:
    """The call's request for `req` (a count's has no sampling: the defaults). Every
    field was checked against Anthropic's rules already."""
    fmt = req.output_config.format if req.output_config else None
    choice = req.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise BadRequest("tool_choice.name: Field required", param="tool_choice.name",
                         code="invalid_request")
    sampling: dict[str, Any] = {}
    if isinstance(req, AnthropicMessagesRequest):
        sampling = args(max_output_tokens=req.max_tokens, temperature=req.temperature,
                        top_p=req.top_p, stop=req.stop_sequences, stream=req.stream,
                        user=req.metadata.user_id if req.metadata else None)
    return CallRequest(
        model=req.model, messages=_chat_messages(req),
        # Anthropic's descriptions may be long (Claude Code's are): the tool prompt
        # reads them whole.
        tools=[ToolSpec(t.name, t.input_schema, bool(t.strict), t.description or "")
               for t in offered(req)],
        response_format=None if fmt is None else json_schema(fmt.schema_, strict=True),
        tool_choice=None if choice is None else _CHOICES.get(choice.type, choice.type),
        tool_name=choice.name if choice is not None and choice.type == "tool" else None,
        idempotency_key=idempotency_key,
        **args(parallel_tool_calls=None if choice is None or
               choice.disable_parallel_tool_use is None
               else not choice.disable_parallel_tool_use),
        **sampling)


_CHOICES = {"any": "required", "tool": "function"}


class Messages(Api):
    path = "/v1/messages"
    action = "messages"
    params = Params({"max_output_tokens": "max_tokens",
                     "response_format": "output_config.format",
                     "tools[].parameters": "tools[].input_schema", "stop": "stop_sequences",
                     "user": "metadata.user_id"}, dotted=True)

    def credential(self, headers: dict[str, str]) -> str | None:
        key = headers.get("x-api-key", "").strip()
        return f"Bearer {key}" if key else headers.get("authorization")

    def error(self, exc: ApiError) -> tuple[int, Any, dict[str, str] | None]:
        return exc.status, encode.error_body(exc), exc.headers

    async def serve(self, ctx: Context) -> None:
        req = await parse_hosted(AnthropicMessagesRequest, ctx)
        call = ctx.call
        call.model = req.model
        call.protocol = "sse" if req.stream else "rest"
        sub = await call.chat(call_request(
            req, idempotency_key=ctx.headers.get("idempotency-key")))
        async with call.watching(ctx.receive, resumable=False):
            if req.stream:
                await encode.stream(sub, req.model, ctx.send,
                                    {**sub.headers, "request-id": sub.handle.rid})
            else:
                body = await encode.message_body(sub, req.model)
                # After the reply: its headers then say what it cost.
                await send_json(ctx.send, 200, body,
                                {**sub.headers, "request-id": sub.handle.rid})


class CountTokens(Messages):
    path = "/v1/messages/count_tokens"
    action = "messages.count_tokens"

    async def serve(self, ctx: Context) -> None:
        req = await parse_hosted(AnthropicCountTokensRequest, ctx)
        tokens = await ctx.call.count(call_request(req))
        await send_json(ctx.send, 200, {"input_tokens": tokens})


register(Messages())
register(CountTokens())


# The routes in the OpenAPI document (streaming/transports/openapi.py adds them).
OPENAPI_MODELS: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
    (AnthropicMessagesRequest, "validation"), (AnthropicCountTokensRequest, "validation"),
    (encode.AnthropicMessage, "serialization"), (encode.AnthropicTokenCount, "serialization"),
    (encode.AnthropicError, "serialization")]


def openapi_paths() -> dict[str, Any]:
    auth = (" Authenticate with `x-api-key: <key>` (Anthropic's header) or "
            "`Authorization: Bearer <key>`; any `anthropic-version` is accepted.")
    return {
        Messages.path: {"post": encode.openapi_operation(
            "messages_create", "Create a message (Anthropic's Messages API)",
            AnthropicMessagesRequest, encode.AnthropicMessage, stream=True,
            description="With `stream: true` the reply is Server-Sent Events: "
                        "`message_start` ... `message_stop`." + auth)},
        CountTokens.path: {"post": encode.openapi_operation(
            "messages_count_tokens", "Count a message's input tokens (Anthropic's API)",
            AnthropicCountTokensRequest, encode.AnthropicTokenCount,
            description="The exact count the model's worker makes (its tokenizer and "
                        "chat template), without generating." + auth)},
    }
