"""The lean /v1 inference path: a plain ASGI app beside Django, no Django request cycle.

It serves the registered APIs (streaming/apis: Chat Completions, Embeddings,
Completions, Responses, Anthropic Messages) and nothing else; everything else goes to
Django. It is a transport only: it routes a POST to its API, authenticates the
credential the API names, opens the call, reads the JSON body and hands them to the
API's `serve`; an error (also one raised before `serve` runs) is sent in the API's own
shape, unless the reply has begun.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.exceptions import RedisError

from sluice.errors import ApiError, BadRequest, ServerError
from sluice.observability.observe import served
from sluice.observability.telemetry import RequestScope
from streaming import apis
from streaming.apis.httpio import ClientGone, Receive, Scope, Send, read_json, send_json
from streaming.pipeline.call import Call
from streaming.pipeline.failures import queue_unavailable
from streaming.pipeline.gateway import shared_gateway
from tenants.throttle import asgi_source

logger = logging.getLogger("sluice.streaming")


class LeanApp:
    ROUTES = apis.APIS

    def __init__(self) -> None:
        self.gateway = shared_gateway()

    def handles(self, path: str) -> bool:
        return path.rstrip("/") in self.ROUTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in scope["headers"]}
        with served(scope["path"].rstrip("/"), "rest", method=scope["method"],
                    headers=headers) as observed:
            await self._serve(scope, headers, receive, send, observed)

    async def _serve(self, scope: Scope, headers: dict[str, str], receive: Receive,
                     send: Send, observed: RequestScope) -> None:
        started = False
        api = apis.APIS[scope["path"].rstrip("/")]

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if not started:
                observed.status = message.get("status", 200)
            started = True
            await send(message)

        try:
            await self._dispatch(scope, headers, receive, tracked_send, api)
        except ClientGone:
            observed.status = observed.status or 499
        except (ApiError, RedisError) as caught:
            # Redis failing under a call (a restart, a failover) is retriable, not a 500.
            exc = queue_unavailable() if isinstance(caught, RedisError) else caught
            if not started:
                await send_json(tracked_send, *api.error(exc))
        except Exception:
            logger.exception("unhandled error on %s", scope.get("path"))
            if not started:
                error = ServerError("The server had an error processing your request.")
                await send_json(tracked_send, *api.error(error))

    async def _dispatch(self, scope: Scope, headers: dict[str, str], receive: Receive,
                        send: Send, api: apis.Api) -> None:
        if scope["method"] != "POST":
            raise BadRequest(f"{scope['method']} is not allowed on {api.path}; use POST.",
                             code="method_not_allowed")
        principal = await self.gateway.authenticate(api.credential(headers),
                                                    source=asgi_source(scope, headers))
        async with Call(self.gateway, principal, action=api.action, protocol="rest",
                        params=api.params) as call:
            data = await read_json(headers, receive)
            await api.serve(apis.Context(self, call, data, headers, receive, send))
