"""The gRPC adapter (`sluice.v1.Inference`): translates protobuf to the gateway
pipeline's calls and its results back, nothing else. Auth, RBAC, limits, quotas,
breakers and audit are the pipeline's, exactly as for REST.

Errors become gRPC statuses (the message is the redacted OpenAI message; trailing
metadata carries `error-type`, `error-code`, and on RESOURCE_EXHAUSTED/UNAVAILABLE
`retry-after` and gRPC's own `grpc-retry-pushback-ms`; an error certain to fail again,
a model fault on this input or a dead-lettered request, carries a pushback of -1, which
tells a client's retry policy not to retry it, gRFC A6). A client deadline becomes the
request's queue deadline; a cancelled call cancels its generation on the worker. A
call's x-sluice-* notes (a clamped max_tokens: streaming/pipeline/max_tokens_policy.py) are its
trailing metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError

from inference.jobs import Message, ResponseFormat, ToolSpec
from inference.selectors import usable_models
from sluice.db import async_db
from sluice.errors import ApiError, BadRequest
from sluice.observability import telemetry
from sluice.observability.observe import served
from streaming.apis import bodies, chat_request
from streaming.pipeline.call import Call
from streaming.pipeline.callrequest import CallRequest, args, json_schema
from streaming.pipeline.fold import Delta, Failure, Final, Fold
from streaming.pipeline.gateway import Gateway
from streaming.pipeline.nesting import MAX_JSON_DEPTH, check_depth
from streaming.pipeline.schemas import EmbeddingRequest, parse
from streaming.pipeline.submitted import Submitted
from streaming.protos import inference_pb2 as pb
from streaming.protos import inference_pb2_grpc as pb_grpc
from tenants.principal import Principal
from tenants.throttle import grpc_source

T = TypeVar("T")
SERVICE = "sluice.v1.Inference"

STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT, 413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED, 503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_of(exc: ApiError) -> grpc.StatusCode:
    return STATUS.get(exc.status, grpc.StatusCode.INTERNAL)


# Where a chat body nests a tool's parameters and a response format's schema: protobuf
# Structs there are held to the depth a REST body's would be (streaming/pipeline/nesting.py).
_PARAMETERS_DEPTH, _SCHEMA_DEPTH = MAX_JSON_DEPTH - 4, MAX_JSON_DEPTH - 3
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_DESCRIPTION_MAX = 32768  # Chat Completions' (streaming/pipeline/schemas.py FunctionDef)


def _call_request(msg: pb.ChatRequest, *, stream: bool,
                  timeout_s: float | None) -> CallRequest:
    """The call's request for a ChatRequest; its ranges are the call's neutral check's
    (streaming/pipeline/callrequest.py), named as Chat Completions names them."""
    messages: list[Message] = []
    for m in msg.messages:
        item: Message = {"role": m.role, "content": m.content}
        if m.name:
            item["name"] = m.name
        if m.tool_call_id and m.role == "tool":
            item["tool_call_id"] = m.tool_call_id
        if m.tool_calls and m.role == "assistant":
            item["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments or "{}"}}
                for c in m.tool_calls]
        messages.append(item)
    tools = []
    for i, t in enumerate(msg.tools):
        if t.type not in ("", "function"):
            raise BadRequest(f"Invalid value for 'tools[{i}].type': only 'function' tools "
                             "are served.", param=f"tools[{i}].type", code="invalid_value")
        if len(t.function.description) > _DESCRIPTION_MAX:
            raise BadRequest(f"Invalid value for 'tools[{i}].function.description': at most "
                             f"{_DESCRIPTION_MAX} characters.",
                             param=f"tools[{i}].function.description", code="invalid_value")
        parameters = MessageToDict(t.function.parameters) \
            if t.function.HasField("parameters") else None
        check_depth(parameters, limit=_PARAMETERS_DEPTH)
        tools.append(ToolSpec(t.function.name, parameters, t.function.strict,
                              t.function.description))
    choice = msg.tool_choice
    return CallRequest(
        model=msg.model, messages=messages, tools=tools, stop=list(msg.stop),
        logprobs=msg.logprobs, logit_bias=dict(msg.logit_bias),
        tool_choice=choice if choice in ("auto", "none", "required") else
        "function" if choice else None, tool_name=None if choice in (
            "", "auto", "none", "required") else choice,
        response_format=_response_format(msg),
        stream=stream, timeout_s=timeout_s,
        **args(max_output_tokens=_optional(msg, "max_tokens"),
               temperature=_optional(msg, "temperature"), top_p=_optional(msg, "top_p"),
               seed=_optional(msg, "seed"),
               presence_penalty=_optional(msg, "presence_penalty"),
               frequency_penalty=_optional(msg, "frequency_penalty"),
               top_logprobs=_optional(msg, "top_logprobs"), n=_optional(msg, "n"),
               parallel_tool_calls=_optional(msg, "parallel_tool_calls"),
               conversation_id=msg.conversation_id or None, user=msg.user or None))


def _optional(msg: pb.ChatRequest, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


def _response_format(msg: pb.ChatRequest) -> ResponseFormat | None:
    fmt = msg.response_format
    if not msg.HasField("response_format") or fmt.type in ("", "text"):
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.type != "json_schema":
        raise BadRequest("Invalid value for 'response_format.type': one of 'text', "
                         "'json_object' or 'json_schema'.", param="response_format.type",
                         code="invalid_value")
    if not fmt.HasField("json_schema"):
        raise BadRequest("Missing required parameter: 'response_format.json_schema'.",
                         param="response_format.json_schema",
                         code="missing_required_parameter")
    if not _NAME.match(fmt.json_schema.name):
        raise BadRequest("Invalid value for 'response_format.json_schema.name': 1 to 64 "
                         "letters, digits, '_' or '-'.",
                         param="response_format.json_schema.name", code="invalid_value")
    schema = MessageToDict(fmt.json_schema.schema) \
        if fmt.json_schema.HasField("schema") else None
    check_depth(schema, limit=_SCHEMA_DEPTH)
    return json_schema(schema, strict=fmt.json_schema.strict)


def _logprobs(content: list[dict[str, Any]]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token=e["token"], logprob=e["logprob"], token_bytes=bytes(e["bytes"]),
                            top_logprobs=[pb.TopLogprob(token=t["token"], logprob=t["logprob"],
                                                        token_bytes=bytes(t["bytes"]))
                                          for t in e["top_logprobs"]]) for e in content]


def _usage(usage: dict[str, Any]) -> pb.Usage:
    return pb.Usage(prompt_tokens=usage["prompt_tokens"],
                    completion_tokens=usage["completion_tokens"],
                    total_tokens=usage["total_tokens"],
                    cached_tokens=usage["prompt_tokens_details"]["cached_tokens"])


def _choice(choice: dict[str, Any]) -> pb.ChatChoice:
    """One choice of a `chat.completion` body."""
    message, logprobs = choice["message"], choice["logprobs"]
    return pb.ChatChoice(
        index=choice["index"], finish_reason=choice["finish_reason"],
        logprobs=_logprobs(logprobs["content"] if logprobs else []),
        message=pb.ChatMessage(role="assistant", content=message["content"] or "",
                               tool_calls=_tool_calls(message.get("tool_calls") or [])))


def _tool_calls(calls: list[dict[str, Any]]) -> list[pb.ToolCall]:
    return [pb.ToolCall(id=c["id"], type="function", index=i, function=pb.FunctionCall(
        name=c["function"]["name"], arguments=c["function"]["arguments"]))
        for i, c in enumerate(calls)]


def _tool_deltas(deltas: list[dict[str, Any]]) -> list[pb.ToolCall]:
    """A stream chunk's pieces of tool calls (`bodies.ToolDeltas`): a call's first has
    its id, type and name; the others only its index and a piece of its arguments."""
    return [pb.ToolCall(id=d.get("id", ""), type=d.get("type", ""), index=d["index"],
                        function=pb.FunctionCall(name=d["function"].get("name", ""),
                                                 arguments=d["function"]["arguments"]))
            for d in deltas]


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self) -> None:
        self.gateway = Gateway()

    async def close(self) -> None:
        await self.gateway.close()

    async def _principal(self, context: grpc.aio.ServicerContext) -> Principal:
        metadata = {k.lower(): v for k, v in context.invocation_metadata() or ()}
        value, forwarded = metadata.get("authorization"), metadata.get("x-forwarded-for")
        return await self.gateway.authenticate(
            value if isinstance(value, str) else None,
            source=grpc_source(context.peer(),
                               forwarded if isinstance(forwarded, str) else None))

    @staticmethod
    def _timeout(context: grpc.aio.ServicerContext) -> float | None:
        remaining = context.time_remaining()
        return None if remaining is None else float(remaining)

    @contextlib.asynccontextmanager
    async def _call(self, context: grpc.aio.ServicerContext, action: str,
                    model: str) -> AsyncIterator[Call]:
        """Authenticate and open the call (streaming/pipeline/call.py: a refusal's audit,
        settlement, cancellation when the RPC is cancelled); ApiErrors become statuses."""
        try:
            principal = await self._principal(context)
            async with Call(self.gateway, principal, action=action, protocol="grpc",
                            params=chat_request.PARAMS) as call:
                call.model = model
                yield call
        except ApiError as exc:
            await _abort(context, exc)

    async def Chat(self, request: pb.ChatRequest,
                   context: grpc.aio.ServicerContext) -> pb.ChatResponse:
        async with self._call(context, "chat.completions", request.model) as call:
            req = _call_request(request, stream=False, timeout_s=self._timeout(context))
            sub = await call.chat(req)
            body = await bodies.chat_completion(sub, req)
            _trailing(context, sub)  # after the reply: with what it cost
            answers = [_choice(choice) for choice in body["choices"]]
            await call.remember(answers[0].message.content)
            return pb.ChatResponse(
                id=body["id"], model=body["model"], message=answers[0].message,
                finish_reason=answers[0].finish_reason, logprobs=answers[0].logprobs,
                usage=_usage(body["usage"]), choices=answers,
                conversation_id=body.get("conversation_id") or "")
        raise AssertionError("unreachable: _call aborts on every error")

    async def ChatStream(self, request: pb.ChatRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ChatChunk]:
        async with self._call(context, "chat.completions", request.model) as call:
            sub = await call.chat(_call_request(request, stream=True,
                                                timeout_s=self._timeout(context)))
            _trailing(context, sub)
            rid, parts = f"chatcmpl-{sub.handle.rid}", []
            tools = [bodies.ToolDeltas() for _ in range(sub.n)]
            async with Fold(sub.events(), sub.n) as fold:
                async for piece in fold:
                    if isinstance(piece, Delta):
                        for calls in tools[piece.i].pieces(piece.tools or []):
                            yield pb.ChatChunk(id=rid, index=piece.i,
                                               tool_calls=_tool_deltas(calls))
                        if piece.text or piece.lp:
                            if piece.i == 0:
                                parts.append(piece.text)
                            yield pb.ChatChunk(id=rid, index=piece.i, delta=piece.text,
                                               logprobs=_logprobs(piece.lp or []))
                    elif isinstance(piece, Failure):
                        raise piece.error  # with n > 1: the others cancelled
                    elif isinstance(piece, Final):
                        final = piece.event
                        yield pb.ChatChunk(
                            id=rid, index=piece.i, finish_reason=bodies.finish_reason(final),
                            tool_calls=_tool_calls(bodies.tool_calls(
                                final.get("tool_calls") or [])),
                            # The stream's last chunk: every choice's usage.
                            usage=_usage(bodies.usage(fold.usage()))
                            if len(fold.finals) == sub.n else None)
            _trailing(context, sub)  # again at the end: with what it cost
            await call.remember("".join(parts))

    async def Embed(self, request: pb.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        async with self._call(context, "embeddings", request.model) as call:
            req = parse(EmbeddingRequest, {"model": request.model,
                                           "input": list(request.input)})
            sub = await call.embed(req, timeout_s=self._timeout(context))
            body = await bodies.embeddings(sub, req)
            _trailing(context, sub)
            return pb.EmbedResponse(model=body["model"], usage=pb.Usage(
                prompt_tokens=body["usage"]["prompt_tokens"],
                total_tokens=body["usage"]["total_tokens"]),
                data=[pb.Embedding(index=d["index"], embedding=d["embedding"])
                      for d in body["data"]])
        raise AssertionError("unreachable: _call aborts on every error")

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        async with self._call(context, "models.list", "") as call:
            usable = await async_db(lambda: usable_models(actor=call.principal))()
            return pb.ListModelsResponse(data=[
                pb.Model(id=m.id, created=m.created, owned_by="sluice",
                         context_window=m.context_window,
                         max_output_tokens=m.max_output_tokens)
                for _, m in sorted(usable.items())])
        raise AssertionError("unreachable: _call aborts on every error")


_SUCCESS = 200
_CANCELLED = 499


class ObservingInterceptor(grpc.aio.ServerInterceptor):
    """Every `sluice.v1.Inference` call as a served request: its server span (parented
    on the caller's `traceparent` metadata), metrics and access log. Health checks and
    reflection pass through unobserved."""

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
            details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        rpc = str(details.method)
        if handler is None or not rpc.startswith(f"/{SERVICE}/"):
            return handler
        metadata = {k.lower(): v for k, v in details.invocation_metadata or ()
                    if isinstance(v, str)}
        parse = _lenient(handler.request_deserializer)
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def observed_unary(request: Any, context: Any) -> Any:
                with served(rpc, "grpc", method="", headers=metadata) as scope:
                    if isinstance(request, Undecodable):
                        await _abort(context, request.error)
                    try:
                        reply = await unary(request, context)
                    except asyncio.CancelledError:
                        scope.status = scope.status or _CANCELLED
                        raise
                    scope.status = scope.status or _SUCCESS
                    return reply
            return grpc.unary_unary_rpc_method_handler(
                observed_unary, request_deserializer=parse,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            stream = handler.unary_stream

            async def observed_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                with served(rpc, "grpc", method="", headers=metadata) as scope:
                    if isinstance(request, Undecodable):
                        await _abort(context, request.error)
                    inner = stream(request, context)
                    try:
                        async for item in inner:
                            yield item
                    except (asyncio.CancelledError, GeneratorExit):
                        scope.status = scope.status or _CANCELLED
                        raise
                    finally:
                        await inner.aclose()  # the servicer's own clean-up runs now
                    scope.status = scope.status or _SUCCESS
            return grpc.unary_stream_rpc_method_handler(
                observed_stream, request_deserializer=parse,
                response_serializer=handler.response_serializer)
        return handler


@dataclass(frozen=True)
class Undecodable:
    """A request message protobuf could not decode, as the handler receives it."""

    error: ApiError


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """`deserialize`, returning an Undecodable for bytes it rejects: gRPC would answer a
    deserializer's exception with UNKNOWN and log it as a server error, where a
    malformed request is the caller's INVALID_ARGUMENT. Protobuf refuses messages
    nested past 100 levels (a Struct of lists within lists: about 50 JSON levels)."""
    def parse(data: bytes) -> Any:
        if deserialize is None:
            return data
        try:
            return deserialize(data)
        except DecodeError as exc:
            if "depth" in str(exc).lower():  # upb: "Exceeded upb_DecodeOptions_MaxDepth"
                return Undecodable(BadRequest(
                    "The request message nests more than 100 levels deep.",
                    code="json_too_deep"))
            return Undecodable(BadRequest("The request is not a valid message of this "
                                          "method.", code="invalid_message"))
    return parse


def _trailing(context: grpc.aio.ServicerContext, sub: Submitted) -> None:
    """What REST sends as the pipeline's own headers (x-sluice-*: a clamped max_tokens,
    a degradation, once the reply ended its cost), as the call's trailing metadata (an
    error's replaces it; a later call replaces an earlier one's)."""
    notes = tuple((k.lower(), v) for k, v in sub.headers.items()
                  if k.lower().startswith("x-sluice-"))
    if notes:
        context.set_trailing_metadata(notes)


async def _abort(context: grpc.aio.ServicerContext, exc: ApiError) -> None:
    error = exc.body()["error"]
    trailing = [("error-type", error["type"]), ("error-code", str(error["code"] or ""))]
    retry = exc.headers.get("Retry-After")
    if retry is not None and retry.isdigit():
        trailing += [("retry-after", retry),
                     ("grpc-retry-pushback-ms", str(int(retry) * 1000))]
    elif status_of(exc) == grpc.StatusCode.RESOURCE_EXHAUSTED:
        seconds = getattr(exc, "retry_after_s", 1.0)
        trailing += [("grpc-retry-pushback-ms", str(math.ceil(seconds * 1000)))]
    elif exc.headers.get("x-should-retry") == "false":
        trailing += [("grpc-retry-pushback-ms", "-1")]
    context.set_trailing_metadata(tuple(trailing))
    scope = telemetry.current_scope()
    if scope is not None:
        scope.status = exc.status
    await context.abort(status_of(exc), error["message"])
