"""The OpenAI Responses API: `POST /v1/responses`, a codec over the gateway's chat call.

The request (`input` as text or items: messages, `function_call`,
`function_call_output`, `custom_tool_call`, `custom_tool_call_output`,
`additional_tools`; `instructions`; function, custom and namespace `tools`
(streaming/apis/responses/tools.py); `tool_choice`; `text.format`; sampling;
`max_output_tokens`; streaming/apis/responses/input.py reads the items) becomes the
call's request (streaming/pipeline/callrequest.py), so it gets the same governance, quotas, audit
(action "responses"), metrics and structured generation as chat. With `previous_response_id`
the call starts from that stored response's chain (streaming/apis/responses/store.py; its
instructions are not carried over, as OpenAI does). With `store` (the default) the reply
is stored before the caller sees it, in Redis (a writer process puts it in the
database, redacted per the tenant's policy): the worker keeps it with the request's
final event (the job carries the draft: responses_store `response_keep`), or, when the
worker did not (a failed stream, a continuation on another deployment), the call
saves it; a next call from any gateway can always find it. With `truncation` "auto"
the messages before the conversation's last user message may be dropped, oldest first,
to fit the model's context (the gateway's `earlier`). A streamed reply is encoded by
streaming/apis/responses/wire.py.

Everything the caller got wrong is a 400 in OpenAI's shape naming the Responses field
(`input[2].call_id`, `text.format.schema`, `max_output_tokens`), never chat's: the
call's neutral parameters are named by `ResponsesApi.params`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from inference.jobs import DoneEvent, Message, ResponseFormat
from sluice.db import async_db
from sluice.errors import ApiError, BadRequest
from streaming.apis import Api, Context, bodies, hosted, register, sse
from streaming.apis.httpio import send_json
from streaming.apis.responses import copy as responses_copy
from streaming.apis.responses.input import chat_messages, given_tools, input_items, invalid
from streaming.apis.responses.store import response_context, response_keep, response_save
from streaming.apis.responses.tools import OWN_TOOLS, ResponsesToolChoice, Tool
from streaming.apis.responses.wire import EventStream, Names, finished, output
from streaming.pipeline.callrequest import CallRequest, Params, args, json_schema
from streaming.pipeline.fold import Delta, Failure, Final, Fold
from streaming.pipeline.schemas import ClientHints, Effort, ModelName, Verbosity
from streaming.pipeline.submitted import Submitted

MAX_ITEMS = 4096
# `client_metadata`: as many keys as `metadata` takes, as long; a value eight times
# `metadata`'s 512 characters, room for five times what Codex sends per turn (751)
# while a request's metadata stays under 66 KB.
CLIENT_METADATA_KEYS, CLIENT_METADATA_KEY, CLIENT_METADATA_VALUE = 16, 64, 4096


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResponsesTextFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    description: Annotated[str, StringConstraints(max_length=4096)] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Strict):
    format: ResponsesTextFormat | None = None
    verbosity: Verbosity | None = None  # a hint for reasoning models: no effect here


class ResponsesReasoning(_Strict):
    """A reasoning model's effort and summaries: no model here reasons, so accepted
    without effect (a reply has no reasoning items)."""

    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # older name
    context: Literal["auto", "current_turn", "all_turns"] | None = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool | None = None  # nothing here is obfuscated either way


class ResponsesRequest(ClientHints):
    model: ModelName
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_ITEMS)]
    instructions: str | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["auto", "none", "required"] | ResponsesToolChoice | None = None
    text: ResponsesText | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    parallel_tool_calls: bool | None = None
    metadata: Annotated[dict[Annotated[str, StringConstraints(max_length=64)],
                             Annotated[str, StringConstraints(max_length=512)]],
                        Field(max_length=16)] | None = None
    store: bool = True
    previous_response_id: Annotated[str, StringConstraints(max_length=64)] | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    # Extra output to include: a reply has no reasoning items to carry encrypted
    # content (what Codex asks for), and no other extra is offered (no logprobs).
    include: Annotated[list[Literal["reasoning.encrypted_content"]],
                       Field(max_length=8)] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    user: Annotated[str, StringConstraints(max_length=256)] | None = None
    reasoning: ResponsesReasoning | None = None
    # Bounds calls of OpenAI's built-in tools; there are none here.
    max_tool_calls: Annotated[int, Field(ge=1, le=1024)] | None = None
    # What the client says about itself (Codex CLI: its installation, its turn, the
    # turn's metadata 751 characters long): checked, then neither kept with a stored
    # response nor written to a log or the audit event. Bounds: CLIENT_METADATA_*.
    client_metadata: Annotated[
        dict[Annotated[str, StringConstraints(min_length=1, max_length=CLIENT_METADATA_KEY)],
             Annotated[str, StringConstraints(max_length=CLIENT_METADATA_VALUE)]],
        Field(max_length=CLIENT_METADATA_KEYS)] | None = None


def droppable(conversation: list[Message], truncation: str | None
              ) -> tuple[list[Message], list[Message]]:
    """With `truncation` "auto": the conversation's messages before its last user
    message, which the worker drops oldest first until the prompt fits the model's
    context (as a conversation's history), and the rest, which stays; else nothing
    droppable."""
    if truncation != "auto":
        return [], conversation
    last_user = max((i for i, m in enumerate(conversation) if m["role"] == "user"),
                    default=0)
    return conversation[:last_user], conversation[last_user:]


# -- the call -----------------------------------------------------------------------------
def response_format(req: ResponsesRequest) -> ResponseFormat | None:
    """The call's response format for `text.format`."""
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.name is None:
        raise BadRequest("Missing required parameter: 'text.format.name'.",
                         param="text.format.name", code="missing_required_parameter")
    return json_schema(fmt.schema_, strict=bool(fmt.strict))


def head(req: ResponsesRequest, rid: str) -> dict[str, Any]:
    """The response object's fields that the request decides."""
    fmt = req.text.format if req.text else None
    choice = req.tool_choice
    return {
        "id": f"resp_{rid}", "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "background": False, "completed_at": None, "error": None,
        "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
        "model": req.model, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                      "summary": None},
        "store": req.store, "service_tier": "default",
        "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier,
        "max_tool_calls": req.max_tool_calls,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt
                 else {"type": "text"},
                 "verbosity": req.text.verbosity if req.text else None},
        "tool_choice": choice.model_dump(exclude_none=True) if isinstance(choice, BaseModel)
        else choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None, "user": req.user,
    }


class ResponsesApi(Api):
    path = "/v1/responses"
    action = "responses"
    params = Params({"messages": "input", "response_format": "text.format"})

    async def serve(self, ctx: Context) -> None:
        data, tools = await hosted.applied(ctx, OWN_TOOLS)
        try:
            req = ResponsesRequest.model_validate(data)
        except ValidationError as exc:
            raise tools.renumbered(invalid(exc)) from None
        call = ctx.call
        call.model = req.model
        call.protocol = "sse" if req.stream else "rest"
        items = input_items(req.input)
        try:
            toolset = given_tools(req.tools, req.input)
        except ApiError as exc:
            raise tools.renumbered(exc) from None
        before = (await async_db(response_context)(actor=ctx.principal,
                                                   response_id=req.previous_response_id)
                  if req.previous_response_id else [])
        system: list[Message] = [{"role": "system", "content": req.instructions}] \
            if req.instructions else []
        conversation = chat_messages([*before, *items])
        earlier, conversation = droppable(conversation, req.truncation)
        choice = req.tool_choice
        try:
            forced = toolset.choice(choice) if isinstance(choice, ResponsesToolChoice) \
                else None
        except ApiError as exc:
            raise tools.renumbered(exc) from None
        fmt = response_format(req)
        base = head(req, "")  # the request's fields; its id is the last attempt's
        keep = None
        if req.store:  # before the call runs: its reply could not be kept
            await responses_copy.keeps_up(call.gateway.client.scripts)
            keep = response_keep(actor=ctx.principal, head=base, input_items=items)
        request = CallRequest(
            model=req.model, messages=system + conversation, earlier=earlier,
            stream=req.stream, tools=toolset.specs, response_format=fmt,
            tool_choice="function" if forced else choice if isinstance(choice, str) else None,
            tool_name=forced, keep=keep, idempotency_key=ctx.headers.get("idempotency-key"),
            **args(max_output_tokens=req.max_output_tokens, temperature=req.temperature,
                   top_p=req.top_p, parallel_tool_calls=req.parallel_tool_calls,
                   user=req.user))
        try:
            sub = await call.chat(request)
        except ApiError as exc:
            raise tools.renumbered(exc) from None
        async with call.watching(ctx.receive, resumable=False):
            if req.stream:
                await self._stream(ctx, sub, req, base, items, toolset.origin)
            else:
                await self._complete(ctx, sub, req, base, items, toolset.origin)

    async def _complete(self, ctx: Context, sub: Submitted, req: ResponsesRequest,
                        base: dict[str, Any], items: list[dict[str, Any]],
                        names: Names) -> None:
        text, final = await bodies.whole_reply(sub)
        rid = sub.handle.rid
        body = finished({**base, "id": f"resp_{rid}"}, output(rid, text, final, names), final)
        if req.store and "kept_at" not in final:  # before the caller sees it: its next
            await response_save(actor=ctx.principal, body=body,  # call must find it
                                input_items=items, scripts=ctx.call.gateway.client.scripts)
        await send_json(ctx.send, 200, body, sub.headers)

    async def _stream(self, ctx: Context, sub: Submitted, req: ResponsesRequest,
                      base: dict[str, Any], items: list[dict[str, Any]],
                      names: Names) -> None:
        fold = Fold(sub.events())
        async with fold, sse.opened(ctx.send, fold, subs=[sub]) as out:
            # The attempt that answers (a model alias's next one when the first failed
            # before any event): its request's id is the response's.
            rid = sub.handle.rid
            stream = EventStream(out, {**base, "id": f"resp_{rid}"}, rid, names)
            stream.start()
            async for piece in fold:
                if isinstance(piece, Delta):
                    if piece.text:
                        stream.text(piece.text)
                    if piece.tools is not None:
                        stream.calls(piece.tools)
                    await out.flush()
                elif isinstance(piece, Failure):
                    await self._finish(ctx, stream, req, items, error=piece.error)
                elif isinstance(piece, Final):
                    # Kept by the worker under this response's id (a continuation on
                    # another deployment is never kept: its reply began here).
                    kept = "kept_at" in piece.event and sub.handle.rid == rid
                    await self._finish(ctx, stream, req, items, final=piece.event,
                                       kept=kept,
                                       cost=bodies.cost(sub, piece.event["usage"]))
        await sse.last(ctx.send, out)

    async def _finish(self, ctx: Context, stream: EventStream, req: ResponsesRequest,
                      items: list[dict[str, Any]], *, final: DoneEvent | None = None,
                      error: ApiError | None = None, kept: bool = False,
                      cost: dict[str, str] | None = None) -> None:
        """The stream's last events (queued: they go with its last message): the output
        closed, the response stored (when asked and the worker did not keep it), then
        completed / incomplete / failed, its usage with `cost` (the call's `cost_usd`
        when priced; not stored: a stored response's usage is OpenAI's)."""
        body = stream.end(final) if final is not None else \
            stream.fail(error or BadRequest("The generation failed."))
        if req.store and not kept:
            try:
                await response_save(actor=ctx.principal, body=body, input_items=items,
                                    scripts=ctx.call.gateway.client.scripts)
            except ApiError as exc:  # Redis went away: the caller must not chain
                body = {**body, "status": "failed", "completed_at": None,
                        "error": {"code": "server_error", "message": exc.message}}
        if cost and body.get("usage"):
            body = {**body, "usage": {**body["usage"], **cost}}
        stream.close(body)


register(ResponsesApi())
