"""The governance steps of the gateway pipeline: admit before enqueue, settle after.

    audit keeping up -> rate limits (token buckets) -> quota reservation
    -> load shedding, memory guard -> circuit breaker  ==> Admission
    ... the call runs ...
    Admission.finish(final event): settle the quota with the real usage, correct the
    token buckets, feed the breaker and the latency window, count usage for billing;
    the recorder writes all of it off the response path (recorder.py).

Redis unreachable: rate limits follow each policy's `fail_open`; quotas fail closed
(503) unless every applicable quota is a shadow; the breaker and shedding fail open (the
queue itself then refuses). A step that refuses undoes the steps before it. An audit
writer far behind (SLUICE_AUDIT_REFUSE_AT events waiting) refuses calls rather than
serve them with events the stream might drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from secrets import token_hex
from typing import Any

from django.conf import settings
from redis.exceptions import RedisError

from governance import audit, breaker, cache, pricing, quota, ratelimit, refusals, signals
from governance.models import BreakerPolicy, DegradeMode, RateLimitPolicy
from governance.recorder import Recorder
from inference import jobs
from inference.client import InferenceClient
from inference.jobs import FinalEvent, is_done, is_error, is_final
from inference.spec import DeploymentSpec
from sluice.aio import finish_or_cancel
from sluice.errors import (
    ApiError,
    DeadlineExceeded,
    RateLimited,
    Unavailable,
    audit_unavailable,
)
from sluice.observability import telemetry
from sluice.ttlcache import AsyncTTLCache
from tenants.principal import Principal

logger = logging.getLogger("sluice.governance")
_LOAD_TTL_S = 0.25  # how stale the queue/worker picture used for shedding may be
_LATENCY_TTL_S = 1.0
_CLOSED_TTL_S = 0.2  # a breaker's state seen is not asked again for this long
_AUDIT_BACKLOG_TTL_S = 1.0  # how stale the audit backlog used for refusing calls may be
_SETTLE_WAIT_GRACE_S = 5.0


@dataclass(frozen=True)
class Load:
    depth: int
    oldest_age_ms: int
    workers: int
    in_rotation: int


@dataclass
class Admission:
    governor: Governor
    principal: Principal
    spec: DeploymentSpec
    tokens: int  # the reserved bound
    id: str = field(default_factory=lambda: token_hex(8))
    headers: dict[str, str] = field(default_factory=dict)
    token_buckets: list[ratelimit.Bucket] = field(default_factory=list)
    quotas: list[quota.Metered] = field(default_factory=list)  # and budgets
    policy: BreakerPolicy | None = None
    probe: bool = False
    # The call's deadline is the caller's (shorter than the platform's timeout): its
    # expiry is not the deployment's failure (set by the gateway at submission).
    caller_deadline: bool = False
    max_tokens_cap: int | None = None
    # The model's price when the call was admitted (None: not priced).
    terms: pricing.Terms | None = None
    started: float = field(default_factory=time.monotonic)
    trace_id: str = field(default_factory=lambda: telemetry.ids()[0])
    done: bool = False
    # For the audit event: set by the gateway and the adapter.
    action: str = "chat.completions"
    protocol: str = "rest"
    request_text: str = ""
    request_id: str = ""
    reply: list[str] = field(default_factory=list)
    patterns: tuple[tuple[str, re.Pattern[str]], ...] = ()  # the tenant's own
    # What the codec adds to the audit event's detail (streaming/pipeline/call.py Call.note).
    notes: dict[str, Any] = field(default_factory=dict)
    _reply_chars: int = 0

    def note_reply(self, text: str) -> None:
        """Keep the start of the reply for the audit excerpt (bounded)."""
        if self._reply_chars < 2 * audit.EXCERPT_CHARS:
            self.reply.append(text)
            self._reply_chars += len(text)

    async def release(self) -> None:
        """Undo the admission: the call never reached a worker (the adapter audits the
        refusal that caused it)."""
        await self.finish(None, charge=False, audited=False)

    async def finish(self, final: FinalEvent | None, *, error: BaseException | None = None,
                     charge: bool = True, audited: bool = True, replay: bool = False) -> None:
        self.finish_now(final, error=error, charge=charge, audited=audited, replay=replay)

    def finish_now(self, final: FinalEvent | None, *, error: BaseException | None = None,
                   charge: bool = True, audited: bool = True,
                   ended: float | None = None, replay: bool = False) -> None:
        """Settle and audit the call (once): queued for the recorder, nothing awaited.
        `ended`: when the call ended (time.monotonic()), when that was before now;
        `replay`: its events were another admission's request's, replayed to an
        idempotent retry (Governor.settle)."""
        if self.done:
            return
        self.done = True
        status = call_status(final, error)
        latency_ms = ((time.monotonic() if ended is None else ended) - self.started) * 1000
        self.governor.settle(self, final, status, latency_ms, error=error, charge=charge,
                             replay=replay)
        if audited:
            self._audit(final, status, latency_ms)

    def cost(self, final: FinalEvent | None) -> int | None:
        """What the call costs in nano-dollars by its price at admission, for the tokens
        its final event counts; None when it is not priced or ended without one."""
        return None if final is None else self.price(final["usage"])

    def price(self, usage: jobs.Usage) -> int | None:
        """What `usage` costs in nano-dollars at the call's price (None: unpriced)."""
        if self.terms is None:
            return None
        return self.terms.cost(usage["prompt_tokens"], usage["completion_tokens"],
                               min(usage.get("cached_tokens", 0), usage["prompt_tokens"]),
                               device_us=usage.get("device_us", 0))

    def audit_detail(self) -> dict[str, Any]:
        """What the call's audit event adds to its detail beyond the finish, the probe
        and the degradation (scalars: the audit keeps detail values small)."""
        return {}

    def _audit(self, final: FinalEvent | None, status: int, latency_ms: float) -> None:
        usage = final["usage"] if final is not None else jobs.usage(0, 0)
        cost = self.cost(final) if status < 500 else None
        self.governor.recorder.audit(audit.call_event(
            principal=self.principal, action=self.action, model=self.spec.name,
            protocol=self.protocol, status=status, latency_ms=latency_ms,
            prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
            request_id=self.request_id, trace_id=self.trace_id, request_text=self.request_text,
            response_text="".join(self.reply), patterns=self.patterns,
            detail={"finish": final["finish"] if final is not None and is_done(final)
                    else None, "probe": self.probe,
                    "degraded": self.max_tokens_cap is not None, **self.audit_detail(),
                    **({} if cost is None else {"cost_usd": pricing.usd(cost)}),
                    **{k: usage[k] for k in ("device_us", "cached_tokens") if k in usage},
                    **self.notes}))


def call_status(final: FinalEvent | None, error: BaseException | None) -> int:
    """How a call ended, as an HTTP status: the worker's error status, 200 when it was
    done, else the error the consumer met (499 when the client left)."""
    if final is not None:
        return final["status"] if is_error(final) else 200
    return error.status if isinstance(error, ApiError) else 499


class Governor:
    def __init__(self, client: InferenceClient) -> None:
        self.client = client
        redis = client.redis
        self._admit = redis.register_script(breaker.ADMIT_LUA)
        self._latency: AsyncTTLCache[tuple[str, int], signals.LatencyStats] = \
            AsyncTTLCache(max_entries=10_000)
        self._load: AsyncTTLCache[str, Load] = AsyncTTLCache(max_entries=10_000)
        # Whether each deployment's breaker is closed: one shared read per TTL, however
        # many calls arrive when it expires (a read per concurrent call had been a
        # quarter of all script calls at 64 connections).
        self._closed: AsyncTTLCache[tuple[str, str], bool] = \
            AsyncTTLCache(max_entries=10_000)
        self._audit_backlog: AsyncTTLCache[str, int] = AsyncTTLCache(max_entries=1)
        self._background: set[asyncio.Task[None]] = set()
        self.recorder = Recorder(redis, self._opened)

    @property
    def redis(self) -> Any:
        return self.client.redis

    # -- admission -------------------------------------------------------------------
    async def admit(self, principal: Principal, spec: DeploymentSpec, *,
                    tokens: int) -> Admission:
        await self._audit_keeps_up()
        policies = await cache.tenant_policies(principal.tenant_id)
        adm = Admission(self, principal, spec, tokens, patterns=policies.redaction)
        prices = await cache.price_versions(spec.name)
        if prices:
            adm.terms = prices.at(datetime.now(UTC))
        limits = policies.limits_for(key_id=principal.key_id, model=spec.name)
        quotas: list[quota.Metered] = [*policies.quotas_for(spec.name), *policies.budgets_for(
            member_id=principal.member_id, key_id=principal.key_id, model=spec.name)]
        try:
            if limits or quotas:
                # One Redis round trip checks the token buckets and reserves the quota.
                with telemetry.stage("sluice.limits", **{"sluice.ratelimit.policies": len(limits),
                                                         "sluice.quota.count": len(quotas)}):
                    await self._limits_and_quotas(adm, limits, quotas)
            adm.policy = await cache.breaker_policy(spec.name)
            # The breaker policy's checks: load shedding, the memory guard, the breaker.
            with telemetry.stage("sluice.breaker") as span:
                await self._shed(adm, adm.policy)
                await self._breaker(adm, adm.policy)
                if span.is_recording():
                    span.set_attribute("sluice.breaker.probe", adm.probe)
        except BaseException:
            await adm.release()
            raise
        return adm

    async def _audit_keeps_up(self) -> None:
        """Refuse the call while the audit stream holds SLUICE_AUDIT_REFUSE_AT events
        the audit writer has not stored: serving it would mean an event the stream may
        have to drop (it is trimmed at audit.STREAM_MAXLEN). One XLEN a second per
        process; Redis away is the enqueue's to report."""
        limit = settings.SLUICE_AUDIT_REFUSE_AT
        if not limit:
            return
        try:
            backlog = await self._audit_backlog.get(
                "", lambda: self.redis.xlen(audit.STREAM), _AUDIT_BACKLOG_TTL_S)
        except RedisError:
            return
        if backlog >= limit:
            raise audit_unavailable()

    async def latency(self, deployment: str, window_s: int) -> signals.LatencyStats:
        return await self._latency.get(
            (deployment, window_s),
            lambda: signals.latency_stats(self.redis, deployment, window_s), _LATENCY_TTL_S)

    async def factor(self, policy: RateLimitPolicy, deployment: str) -> float:
        if not policy.adaptive:
            return 1.0
        stats = await self.latency(deployment, policy.window_s)
        return ratelimit.adaptive_factor(policy, stats.qps, stats.p99_ms)

    async def _limits_and_quotas(self, adm: Admission,
                                 limits: list[tuple[RateLimitPolicy, str]],
                                 quotas: list[quota.Metered]) -> None:
        """The token buckets and the quota and budget reservation in one round trip (both
        scripts touch only the tenant's slot), shared with concurrent calls' scripts. A
        refusal by one undoes the other on release. A budget holds the call's worst-case
        cost at the price of its admission (none: the call costs nothing)."""
        tenant = adm.principal.tenant_slug
        buckets: list[ratelimit.Bucket] = []
        try:
            for policy, subject in limits:
                factor = await self.factor(policy, adm.spec.name)
                buckets += ratelimit.buckets_for(policy, tenant=tenant, subject=subject,
                                                 factor=factor)
            costs = [1 if b.kind == "requests" else adm.tokens for b in buckets]
            scripts = self.client.scripts  # with other calls' scripts: one round trip
            calls = []
            if buckets:
                calls.append(scripts.script(ratelimit.BUCKETS_LUA, [b.key for b in buckets],
                                            ratelimit.args_for(buckets, costs, "check")))
            if quotas:
                hold = settings.SLUICE_REQUEST_TIMEOUT_S + 30
                worst = (adm.terms.worst(adm.tokens, settings.SLUICE_REQUEST_TIMEOUT_S)
                         if adm.terms is not None else 0)
                calls.append(scripts.script(
                    quota.RESERVE_LUA, quota.keys_for(tenant, quotas),
                    quota.reserve_args(adm.id, hold, quotas, adm.tokens, cost=worst)))
            replies = await asyncio.gather(*calls)
        except RedisError:
            if quotas:
                # The reservation may have been made with only its reply lost: release
                # it when Redis answers again (releasing one never made is a no-op).
                self.recorder.settle(tenant, quotas, quota.Settlement(adm.id, "", 0, 0, 0, ""))
            self._without_redis(adm, limits, quotas)
            return
        if quotas and replies[-1][0] == 1:
            adm.quotas = quotas  # reserved: a refusal below releases it
        if buckets:
            self._check_limits(adm, buckets, costs, replies[0])
        if quotas:
            self._check_quota(adm, quotas, replies[-1])

    @staticmethod
    def _without_redis(adm: Admission, limits: list[tuple[RateLimitPolicy, str]],
                       quotas: list[quota.Metered]) -> None:
        if not all(getattr(q, "shadow", False) for q in quotas):  # budgets: never shadow
            raise Unavailable("Quota accounting is unavailable; refusing rather than "
                              "risking overspend. Try again shortly.",
                              code="quota_unavailable", headers={"Retry-After": "1"})
        if not all(policy.fail_open for policy, _ in limits):
            raise Unavailable("Rate limiting is unavailable; try again shortly.",
                              code="rate_limit_unavailable", headers={"Retry-After": "1"})
        logger.warning("rate limits and quotas unavailable (Redis); admitting (fail open)")
        adm.headers["x-ratelimit-status"] = "unavailable"

    @staticmethod
    def _check_limits(adm: Admission, buckets: list[ratelimit.Bucket], costs: list[int],
                      reply: list[int]) -> None:
        verdict = ratelimit.verdict(buckets, reply)
        adm.headers.update(verdict.headers())
        if not verdict.allowed:
            short = next(s for s, c in zip(verdict.states, costs, strict=True)
                         if s.remaining < min(c, s.bucket.capacity))
            kind = short.bucket.kind
            raise RateLimited(
                f"Rate limit reached for {kind} per minute on model '{adm.spec.name}': "
                f"limit {int(short.bucket.per_minute)}, burst {int(short.bucket.capacity)}, "
                f"remaining {max(0, short.remaining)}. Try again in "
                f"{ratelimit.duration(verdict.wait_s)}.",
                retry_after_s=verdict.wait_s, code=f"rate_limit_{kind}",
                headers={**verdict.headers(),
                         "Retry-After": str(max(1, math.ceil(verdict.wait_s)))})
        adm.token_buckets = [b for b in buckets if b.kind == "tokens"]

    @staticmethod
    def _check_quota(adm: Admission, quotas: list[quota.Metered], reply: list[Any]) -> None:
        if reply[0] == 0:
            raise refusals.over_quota(refusals.refusal(quotas, reply), adm.spec.name)
        for hit, metric in refusals.shadow_hits(quotas, reply):
            logger.info("shadow quota %s would refuse (%s) for tenant %s", hit.pk, metric,
                        adm.principal.tenant_slug)
            adm.headers["x-sluice-quota-shadow"] = f"{hit.pk}:{metric}"

    async def load(self, deployment: str) -> Load:
        async def fetch() -> Load:
            stats = await self.client.queue_stats(deployment)
            workers = await self.client.workers(deployment)
            return Load(depth=stats["depth"], oldest_age_ms=stats["oldest_age_ms"],
                        workers=len(workers),
                        in_rotation=sum(1 for w in workers.values()
                                        if w.get("in_rotation", True)))
        return await self._load.get(deployment, fetch, _LOAD_TTL_S)

    async def _shed(self, adm: Admission, policy: BreakerPolicy) -> None:
        try:
            load = await self.load(adm.spec.name)
        except RedisError:
            return
        # Priority traffic may use the whole room; the rest is shed at (1 - share) of it.
        room = 1.0 if adm.principal.priority > 0 else 1.0 - policy.priority_share
        name = adm.spec.name
        if policy.shed_queue_depth and load.depth >= policy.shed_queue_depth * room:
            raise Unavailable(f"Model '{name}' is shedding load: {load.depth} requests are "
                              "queued. Try again shortly.", code="load_shed",
                              headers={"Retry-After": "1"})
        if policy.shed_oldest_age_ms and load.oldest_age_ms >= policy.shed_oldest_age_ms * room:
            raise Unavailable(f"Model '{name}' is shedding load: its oldest queued request "
                              f"waited {load.oldest_age_ms} ms. Try again shortly.",
                              code="load_shed", headers={"Retry-After": "1"})
        if load.workers and not load.in_rotation:
            if policy.degrade_mode == DegradeMode.REJECT:
                raise Unavailable(f"Model '{name}' is out of device memory on every worker. "
                                  "Try again shortly.", code="memory_pressure",
                                  headers={"Retry-After": str(max(1, math.ceil(
                                      policy.memory_hold_s)))})
            adm.max_tokens_cap = policy.degraded_max_tokens
            adm.headers["x-sluice-degraded"] = "memory"

    async def _breaker(self, adm: Admission, policy: BreakerPolicy) -> None:
        name = adm.spec.name
        try:
            tenant = adm.principal.tenant_slug
            if await self._closed.get((name, tenant),
                                      lambda: breaker.is_closed(self.redis, name, tenant),
                                      _CLOSED_TTL_S):
                return
            # Open, half open or this tenant refused alone: the call's own verdict (it
            # may become a probe).
            verdict, retry_ms = await self._admit(
                keys=breaker.keys(name), args=breaker.admit_args(adm.id, policy, tenant))
        except RedisError:
            return
        if verdict == 2:
            adm.probe = True
        elif verdict != 1:
            raise Unavailable(f"Model '{name}' is temporarily unavailable: its circuit "
                              "breaker is open after repeated failures.", code="circuit_open",
                              headers={"Retry-After": str(max(1, math.ceil(retry_ms / 1000)))})

    # -- settlement ------------------------------------------------------------------
    def finish_later(self, adm: Admission, final: FinalEvent | None,
                     error: BaseException | None, rid: str, deadline_ms: int, *,
                     charge: bool = True, replay: bool = False) -> None:
        """The consumer stopped before the call ended (client gone, stream left for a
        resume): settle when the worker's final event arrives (a cancel makes it come
        within milliseconds), or at the deadline."""
        async def run() -> None:
            event = final
            if event is None and charge and not isinstance(error, DeadlineExceeded):
                timeout = max(0.0, deadline_ms / 1000 - time.time()) + _SETTLE_WAIT_GRACE_S
                with contextlib.suppress(ApiError, RedisError):
                    async for item in self.client.replay(adm.principal.tenant_slug, rid,
                                                         after_seq=2**62, timeout_s=timeout):
                        if is_final(item):
                            event = item
            await adm.finish(event, error=error, charge=charge, replay=replay)

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def settle(self, adm: Admission, final: FinalEvent | None, status: int,
               latency_ms: float, *,
               error: BaseException | None, charge: bool, replay: bool = False) -> None:
        """Queue the call's settlement (written by the recorder, off the response path);
        `status` is `call_status(final, error)`, `latency_ms` the call's duration. The
        charge is booked under the request's id, once whoever settles it (quota.py):
        a `replay` (the events of a request another admission ran, fed to an idempotent
        retry) charges what its final event says when nobody has (the gateway that ran
        it died); it is not the deployment's outcome, and its token-bucket estimate is
        refunded (the request's own admission paid the buckets)."""
        prompt, completion = ((final["usage"]["prompt_tokens"],
                               final["usage"]["completion_tokens"]) if final is not None
                              else (0, 0))
        outcome = (breaker.Outcome.IGNORED if not charge or replay else
                   breaker.outcome_of(final, status, error=error,
                                      caller_deadline=adm.caller_deadline))
        # The tenant pays for what was made, except when the platform failed.
        billable = charge and final is not None and status < 500
        tokens = prompt + completion if billable else 0
        tenant, name = adm.principal.tenant_slug, adm.spec.name
        rec = self.recorder
        if adm.quotas or billable:
            rec.settle(tenant, adm.quotas, quota.Settlement(
                adm.id, adm.request_id or adm.id, int(billable), prompt if billable else 0,
                completion if billable else 0, f"{name}|{adm.principal.key_prefix}|",
                (adm.cost(final) or 0) if billable else 0))
        if adm.token_buckets:
            # The estimate was debited up front: book the difference (a refund, mostly).
            rec.correct_buckets(tenant, adm.token_buckets,
                                (0 if replay else tokens) - adm.tokens)
        policy = adm.policy
        if policy is not None and adm.probe:
            rec.write(breaker.RECORD_LUA, breaker.keys(name),
                      breaker.record_args(adm.id, [(outcome, latency_ms, tenant)], policy))
        elif policy is not None and outcome != breaker.Outcome.IGNORED:
            rec.outcome(name, policy, outcome, latency_ms, tenant)
        if outcome != breaker.Outcome.IGNORED:
            rec.latency(name, latency_ms)

    def _opened(self, deployment: str) -> None:
        # Its state is cached per tenant; opening is rare: forget every state seen.
        self._closed.clear()

    async def close(self, *, grace_s: float = 2.0) -> None:
        """Shutdown: give calls that are ending `grace_s` to settle, then write what is
        pending. Calls still running keep their reservations until those expire."""
        await finish_or_cancel(self._background, grace_s)
        await self.recorder.close()
