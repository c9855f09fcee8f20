"""A local OpenAI-compatible upstream for proxy comparisons: POST .../chat/completions
answers the last user message back (what Sluice's echo deployment does, one byte one
token), with no model and no framework: what a proxy in front of it costs is then what
the comparison measures."""

from __future__ import annotations

import json
import time
from typing import Any

from bare_asgi import BODY, read_body


def reply(request: dict[str, Any]) -> bytes:
    users = [m for m in request.get("messages", []) if m.get("role") == "user"]
    text = str(users[-1].get("content", "")) if users else ""
    tokens = len(text.encode())
    return json.dumps({
        "id": f"chatcmpl-mock{time.monotonic_ns()}", "object": "chat.completion",
        "created": int(time.time()), "model": request.get("model", "echo"),
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": tokens, "completion_tokens": tokens,
                  "total_tokens": 2 * tokens},
    }).encode()


def error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": None}}).encode()


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = await read_body(receive)
    if scope["method"] == "POST" and scope["path"].endswith("/chat/completions"):
        try:
            status, out = 200, reply(json.loads(body))
        except (ValueError, AttributeError):
            status, out = 400, error("bad JSON")
    elif scope["method"] == "GET" and scope["path"] == "/":
        status, out = 200, BODY  # up (what bench_http.wait_http asks)
    else:
        status, out = 404, error("not found")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": out})
