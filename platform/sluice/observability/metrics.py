"""Prometheus metrics: what this process served, and the endpoint that shows them.

Per process (counters and histograms, updated on the request path):
    sluice_requests_total{route,protocol,model,status}
    sluice_request_duration_seconds{route,protocol,model}
    sluice_time_to_first_token_seconds{model}
    sluice_output_tokens_per_second{model}            decode rate of each generation
    sluice_tokens_total{model,kind}                   kind: prompt | completion
    sluice_ratelimit_rejections_total{model,limit}    limit: requests | tokens | tenant_queue
    sluice_quota_rejections_total{model}
    sluice_load_shed_total{model,reason}              load_shed | circuit_open | memory_pressure
Beside them, what collectors added with `add_collector` read at scrape time (the
cluster's state, by whichever process is scraped: governance/cluster_metrics.py).

`model` is only ever a deployment the pipeline resolved (never the caller's raw string),
so the label's values stay bounded. With `PROMETHEUS_MULTIPROC_DIR` set (the run command
sets it) every local serving process writes its series there and one scrape of /metrics
sums them all.

/metrics is served beside the API: with `SLUICE_METRICS_TOKEN` set it wants
`Authorization: Bearer <token>`; without one it answers loopback clients only.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

from django.conf import settings
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
_TPS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)

REQUESTS = Counter("sluice_requests", "Requests served, by route, protocol, model and "
                   "HTTP-equivalent status.", ["route", "protocol", "model", "status"])
DURATION = Histogram("sluice_request_duration_seconds", "Time from request to the last "
                     "byte of the response.", ["route", "protocol", "model"],
                     buckets=_LATENCY_BUCKETS)
TTFT = Histogram("sluice_time_to_first_token_seconds", "Time from request to the first "
                 "generated token.", ["model"], buckets=_LATENCY_BUCKETS)
TOKENS_PER_S = Histogram("sluice_output_tokens_per_second", "Decode rate of each "
                         "generation after its first token.", ["model"], buckets=_TPS_BUCKETS)
TOKENS = Counter("sluice_tokens", "Tokens processed.", ["model", "kind"])
RATELIMITED = Counter("sluice_ratelimit_rejections", "Calls refused by a rate limit.",
                      ["model", "limit"])
QUOTA_REFUSED = Counter("sluice_quota_rejections", "Calls refused by a quota.", ["model"])
GUARD_VERDICTS = Counter("sluice_guardrail_verdicts", "Guardrail checks by guard, phase "
                         "and outcome (allow, block, mask, flag, shadow, error).",
                         ["guard", "phase", "outcome"])
GUARD_SECONDS = Histogram("sluice_guardrail_duration_seconds", "Time a guard took to "
                          "answer.", ["guard", "phase"], buckets=_LATENCY_BUCKETS)
SHED = Counter("sluice_load_shed", "Calls refused to protect a deployment.",
               ["model", "reason"])

_REFUSALS: dict[str, Callable[[str], None]] = {
    "rate_limit_requests": lambda m: _child(RATELIMITED, m, "requests").inc(),
    "rate_limit_tokens": lambda m: _child(RATELIMITED, m, "tokens").inc(),
    "tenant_queue_full": lambda m: _child(RATELIMITED, m, "tenant_queue").inc(),
    "quota_exceeded": lambda m: _child(QUOTA_REFUSED, m).inc(),
    "load_shed": lambda m: _child(SHED, m, "load_shed").inc(),
    "circuit_open": lambda m: _child(SHED, m, "circuit_open").inc(),
    "memory_pressure": lambda m: _child(SHED, m, "memory_pressure").inc(),
}


# Each labelled child once: `labels()` (validation, a lock, string conversion) was ~2% of
# a governed call. Bounded as the labels are (resolved deployments, our own routes).
_children: dict[tuple[Any, tuple[Any, ...]], Any] = {}


def _child(metric: Any, *values: Any) -> Any:
    key = (metric, values)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*values)
    return child


def observe_request(route: str, protocol: str, model: str, status: int,
                    seconds: float) -> None:
    _child(REQUESTS, route, protocol, model, status).inc()
    _child(DURATION, route, protocol, model).observe(seconds)


def observe_refusal(model: str, code: str | None) -> None:
    """Count a governance refusal (rate limit, quota, shedding) by its error code."""
    count = _REFUSALS.get(code or "")
    if count is not None and model:
        count(model)


def observe_guard(guard: str, phase: str, outcome: str, seconds: float) -> None:
    _child(GUARD_VERDICTS, guard, phase, outcome).inc()
    _child(GUARD_SECONDS, guard, phase).observe(seconds)


def observe_generation(model: str, *, ttft_s: float | None, decode_s: float,
                       prompt_tokens: int, completion_tokens: int) -> None:
    if ttft_s is not None:
        _child(TTFT, model).observe(ttft_s)
    if completion_tokens > 1 and decode_s > 0:
        _child(TOKENS_PER_S, model).observe((completion_tokens - 1) / decode_s)
    if prompt_tokens:
        _child(TOKENS, model, "prompt").inc(prompt_tokens)
    if completion_tokens:
        _child(TOKENS, model, "completion").inc(completion_tokens)


_registry: CollectorRegistry | None = None
_collectors: list[Collector] = []


def add_collector(collector: Collector) -> None:
    """Have /metrics also show what `collector` reads at scrape time (the composition
    root adds the cluster's state: governance/cluster_metrics.py)."""
    _collectors.append(collector)
    if _registry is not None:
        _registry.register(collector)


def registry() -> CollectorRegistry:
    """What /metrics shows: this process's series (or every local process's, in
    multiprocess mode) plus what the added collectors read (add_collector)."""
    global _registry
    if _registry is None:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            reg = CollectorRegistry()
            multiprocess.MultiProcessCollector(reg)
        else:
            reg = REGISTRY
        for collector in _collectors:
            reg.register(collector)
        _registry = reg
    return _registry


def allowed(client_host: str | None, authorization: str | None) -> bool:
    token = settings.SLUICE_METRICS_TOKEN
    if token:
        given = (authorization or "")[7:] if (authorization or "").lower().startswith(
            "bearer ") else ""
        return hmac.compare_digest(given.encode(), token.encode())
    try:
        return client_host is not None and ipaddress.ip_address(client_host).is_loopback
    except ValueError:
        return False


async def serve(scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """The /metrics endpoint (ASGI)."""
    headers = {k.decode().lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    client = (scope.get("client") or (None,))[0]
    if not allowed(client, headers.get("authorization")):
        status, body, kind = 403, json.dumps({"error": {
            "message": "Metrics need the scrape token (SLUICE_METRICS_TOKEN) or a loopback "
                       "client.", "type": "permission_error", "param": None,
            "code": "forbidden"}}).encode(), "application/json"
    else:
        status, kind = 200, CONTENT_TYPE_LATEST
        body = await asyncio.to_thread(generate_latest, registry())
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", kind.encode())]})
    await send({"type": "http.response.body", "body": body})
