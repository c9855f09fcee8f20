"""The APIs the lean ASGI path serves (Chat Completions, Embeddings, legacy
Completions, Responses, Anthropic Messages), each a codec over the one gateway call.

An `Api` is registered under its path in APIS. The lean app (streaming/transports/asgi.py) does
the same for every one of them: authenticates the credential the API names
(`credential`), throttles wrong ones, opens the call (streaming/pipeline/call.py: the audit of a
refusal, settlement, cancellation), reads the JSON body within the size and nesting
limits, and sends any error in the API's own shape (`error`). `serve` does the rest:
validate the body against the API's own schema (a 400 in the API's shape and words for
anything wrong), build the call's request from it once (streaming/pipeline/callrequest.py),
admit it through `ctx.call` (whose errors name their parameter by the API's `params`),
and encode the call's events, read through the one fold (streaming/pipeline/fold.py; a stream
opened by streaming/apis/sse.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.errors import ApiError
from streaming.pipeline.callrequest import NEUTRAL, Params

if TYPE_CHECKING:
    from streaming.apis.httpio import Receive, Send
    from streaming.pipeline.call import Call
    from streaming.transports.asgi import LeanApp
    from tenants.principal import Principal


@dataclass
class Context:
    """One request to an Api: the app (its gateway), the call, the parsed body, the
    headers and the ASGI channels."""

    app: LeanApp
    call: Call
    data: dict[str, Any]
    headers: dict[str, str]
    receive: Receive
    send: Send

    @property
    def principal(self) -> Principal:
        return self.call.principal


class Api:
    path: str = ""
    action: str = ""  # the audit action of its calls
    # The API's names for the call request's neutral parameters (streaming/pipeline/callrequest.py).
    params: Params = NEUTRAL

    def credential(self, headers: dict[str, str]) -> str | None:
        """The `Authorization` value to authenticate (`Bearer <key or token>`)."""
        return headers.get("authorization")

    def error(self, exc: ApiError) -> tuple[int, Any, dict[str, str] | None]:
        """(status, body, headers) of an error in this API's shape (OpenAI's here)."""
        return exc.status, exc.body(), exc.headers

    async def serve(self, ctx: Context) -> None:
        raise NotImplementedError


APIS: dict[str, Api] = {}


def register(api: Api) -> Api:
    APIS[api.path] = api
    return api


def _load() -> None:
    """Import the API modules (each registers itself)."""
    import importlib

    for name in _MODULES:
        importlib.import_module(f"streaming.apis.{name}")


_MODULES: list[str] = ["chat", "embeddings", "completions", "messages.codec", "responses.codec",
                       "moderations"]
_load()
