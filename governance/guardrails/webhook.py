"""The webhook guard: a guardrail service that speaks LiteLLM's generic guardrail API,
so a vendor's service built for LiteLLM plugs in unchanged.

    POST {config.url}/beta/litellm_basic_guardrail_api
    {"texts": [...], "input_type": "request" | "response",
     "litellm_call_id": <request id>, "request_data": {"user_api_key_alias": <key
     prefix>, "user_api_key_team_id": <tenant>, "model": <model>},
     "additional_provider_specific_params": config.params}
    -> {"action": "NONE" | "BLOCKED" | "GUARDRAIL_INTERVENED",
        "blocked_reason": "...", "texts": [... rewritten, one per text sent]}

Sluice adds `x-sluice-signature: t=<epoch>,v1=<HMAC-SHA256 of "<t>.<body>">` with the
policy's secret (the budget alerts' scheme, governance/alerts.py), so the service can
tell Sluice's calls from anyone's. Connections go through the upstream SSRF guard at
each connect (inference/upstream/network.py: the address checked is the one dialled),
kept alive per event loop. Anything but a 2xx JSON object of that shape (a slow, failing
or malformed answer, a connection refused) is a `GuardFailed`: the policy's `on_error`
decides, under its `timeout_ms` (runner.py).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from typing import Any

import orjson

from governance.alerts import sign
from governance.guardrails.guards import Context, Guard, Verdict
from governance.guardrails.policy import Policy
from inference.upstream.network import NetworkError, Pool, Timeouts
from inference.upstream.secrets import unseal
from inference.upstream.urls import allow_private

PATH = "/beta/litellm_basic_guardrail_api"
SIGNATURE_HEADER = "x-sluice-signature"
REPLY_MAX = 1 << 20


class GuardFailed(Exception):
    """The guard gave no usable verdict."""


class WebhookGuard(Guard):
    def __init__(self, policy: Policy) -> None:
        self.url = str(policy.config.get("url", ""))
        self.params = policy.config.get("params") or {}
        self.secret = unseal(policy.secret_sealed).reveal() if policy.secret_sealed else ""
        self.timeout_s = policy.timeout_s
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Pool] = \
            weakref.WeakKeyDictionary()
        path = self.url.split("://", 1)[-1]
        self._target = (path[path.index("/"):] if "/" in path else "") + PATH

    def _pool(self) -> Pool:
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None:
            pool = self._pools[loop] = Pool(self.url, private_ok=allow_private(),
                                            max_connections=16)
        return pool

    async def check(self, texts: Sequence[str], ctx: Context) -> Verdict:
        body = orjson.dumps({
            "texts": list(texts),
            "input_type": "response" if ctx.phase == "post" else "request",
            "litellm_call_id": ctx.request_id,
            "request_data": {"user_api_key_alias": ctx.key_prefix,
                             "user_api_key_team_id": ctx.tenant, "model": ctx.model},
            "additional_provider_specific_params": self.params})
        headers = [(b"Content-Type", b"application/json"), (b"Accept", b"application/json")]
        if self.secret:
            headers.append((SIGNATURE_HEADER.encode(), sign(self.secret, body).encode()))
        timeouts = Timeouts(connect=self.timeout_s, read=self.timeout_s)
        try:
            async with self._pool().request("POST", self._target, headers=headers,
                                            body=body, timeouts=timeouts) as reply:
                data = await _whole(reply.parts())
                status = reply.status
        except NetworkError as exc:
            raise GuardFailed(f"{type(exc).__name__} reaching the guardrail service") from None
        if not 200 <= status < 300:
            raise GuardFailed(f"the guardrail service answered {status}")
        return _verdict(data, len(texts))


async def _whole(parts: Any) -> bytes:
    out, size = [], 0
    async for part in parts:
        size += len(part)
        if size > REPLY_MAX:
            raise GuardFailed("the guardrail service's answer is too large")
        out.append(part)
    return b"".join(out)


def _verdict(data: bytes, count: int) -> Verdict:
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise GuardFailed("the guardrail service's answer is not JSON") from None
    if not isinstance(answer, dict):
        raise GuardFailed("the guardrail service's answer is not an object")
    action = answer.get("action")
    reason = str(answer.get("blocked_reason") or "")[:200]
    if action == "NONE":
        return Verdict(False)
    if action == "BLOCKED":
        return Verdict(True, "BLOCKED", reason=reason)
    if action == "GUARDRAIL_INTERVENED":
        texts = answer.get("texts")
        if not isinstance(texts, list) or len(texts) != count or \
                not all(isinstance(t, str) for t in texts):
            raise GuardFailed("GUARDRAIL_INTERVENED without one string per text sent")
        return Verdict(True, "INTERVENED", texts=tuple(texts), reason=reason)
    raise GuardFailed(f"unknown action {str(action)[:40]!r}")
