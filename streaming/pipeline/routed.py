"""A call to a model alias: the deployments it tries, in which order, and when it moves
on to the next.

    alias_route(name) (cached) -> routing.plan(route, rng, unavailable, prompt_bound)
    -> attempt: admission + enqueue on one deployment (the gateway's, as for a call
       naming that deployment) -> the call's events (streaming/pipeline/submitted.py)
    a retriable failure -> backoff_s -> the next deployment of the plan, while the
       call's deadline allows

- The plan (inference/routing.py) leaves out disabled deployments, those whose breaker
  is open (governance/breaker.py: open and not yet due for a half-open probe, read
  through `Breakers`) and those whose context cannot hold the call (the prompt's bound,
  streaming/pipeline/prompting.py, plus the max_tokens asked).
- Retriable, so the call moves on: an admission refused by the deployment's breaker,
  its load shedding or memory guard, a rate limit (the deployment's own tenant x model
  limit is the one another deployment can pass), its full queue; and, before the
  caller has any text (no delta event yet), a worker's error event with a status of
  500 or more or 429 that does not say `retry: false` (`retriable_failure`). Anything
  else (a quota, the caller's 4xx, an error after text was sent) is the call's answer.
- Each attempt is admitted and settled on its own: quotas, rate limits, breakers,
  usage and latency are those of the deployment actually used. The call has one audit
  event, its last attempt's (`RoutedAdmission`): its model is the deployment that
  answered, its detail names the alias and every failed attempt.
- A call with n > 1 choices moves on at admission only (its n streams are not
  restarted).
- After text was sent, a retriable failure moves a single-choice call on as a
  continuation (`resume`: the text streamed so far, the next sequence number, the
  completion tokens billed for it), to the next deployments that can continue it only:
  upstream ones whose dialect continues the job (a legacy completion everywhere, a
  chat reply on vLLM and SGLang: inference/upstream/body.py `continues`); the others
  are left out (`cannot_continue`). The audit event's `fallback_from` names the
  deployments whose reply was continued.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from governance import cache as policies
from governance.admission import Admission
from inference import queue as q
from inference.cache import enabled_spec
from inference.client import RequestHandle
from inference.jobs import Continuation, ErrorEvent
from inference.routing import Plan, Route, Skip, backoff_s, plan
from inference.spec import DeploymentSpec, Kind, RuntimeName
from inference.upstream.body import continues
from sluice.errors import ApiError, BadRequest, Unavailable
from sluice.observability import telemetry
from streaming.pipeline.prompting import prompt_bound

if TYPE_CHECKING:
    from streaming.pipeline.submitted import Submitted

# Refusals that another deployment may not make (see the module docstring).
RETRIABLE_REFUSALS = frozenset({"circuit_open", "load_shed", "memory_pressure", "overloaded",
                                "rate_limit_requests", "rate_limit_tokens",
                                "tenant_queue_full"})
_BREAKER_TTL_S = 0.2  # how stale a breaker's state read for routing may be
# prompt_bound caps its bound at the spec's context; routing compares it with each
# deployment's, so it is computed against no cap at all.
_UNCAPPED = DeploymentSpec(name="", runtime=RuntimeName.ECHO, max_context=2**40)
_rng = random.SystemRandom()

Attempt = Callable[[DeploymentSpec, "Routed"], Awaitable["Submitted"]]


def retriable_refusal(exc: ApiError) -> bool:
    return exc.code in RETRIABLE_REFUSALS


def retriable_failure(event: ErrorEvent) -> bool:
    """A worker's error event another deployment may not repeat."""
    return (event["status"] >= 500 or event["status"] == 429) and event.get("retry") is not False


def call_bound(texts: Iterable[str], max_tokens: int | None) -> int:
    """The call's tokens at most, as routing compares them with a deployment's context:
    the prompt's bound and the reply's max_tokens when the caller set one (otherwise
    each deployment's default fits its own context)."""
    return prompt_bound(list(texts), _UNCAPPED) + (max_tokens or 0)


class Breakers:
    """Which deployments routing must leave out for their breaker: open, and not yet due
    for a half-open probe (one that is due is tried: its admission decides). Read from
    the breakers' shared state (one pipelined HMGET for the deployments not seen within
    _BREAKER_TTL_S), per process; when Redis fails, only what was already known open is
    left out (the breaker's own admission fails open too)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, float]] = {}  # name -> (fresh until, open until)

    async def unavailable(self, redis: Any, names: list[str]) -> dict[str, Skip]:
        now = time.monotonic()
        stale = [n for n in names if self._seen.get(n, (0.0, 0.0))[0] <= now]
        if stale:
            pipe = redis.pipeline(transaction=False)
            for name in stale:
                pipe.hmget(q.deployment_key(name, "br"), "state", "opened_at")
            try:
                replies = await pipe.execute()
            except RedisError:  # as the breaker's own admission does: fail open
                return {n: Skip.BREAKER_OPEN for n in names
                        if self._seen.get(n, (0.0, 0.0))[1] > now}
            wall = time.time()
            for name, (state, opened_at) in zip(stale, replies, strict=True):
                open_until = 0.0
                if state is not None and _s(state) == "open" and opened_at is not None:
                    wait = (await policies.breaker_policy(name)).open_wait_s
                    open_until = now + float(_s(opened_at)) + wait - wall
                self._seen[name] = (now + _BREAKER_TTL_S, open_until)
        return {n: Skip.BREAKER_OPEN for n in names if self._seen[n][1] > now}


breakers = Breakers()


@dataclass
class Routed:
    """One alias call's routing: the deployments still to try, in order, the failed
    attempts (for the audit event), and the call's deadline (time.monotonic())."""

    alias: str
    kind: Kind
    order: list[str]
    deadline: float
    attempt: Attempt
    skipped: dict[str, str] = field(default_factory=dict)  # a Skip, or cannot_continue
    failed: list[dict[str, Any]] = field(default_factory=list)
    prompt_only: bool = False  # a legacy completion (what a continuation may go to)
    clamps: bool = False  # the alias clamps max_tokens (streaming/pipeline/max_tokens_policy.py)
    # What the caller already has of the reply, when a failed attempt had sent text:
    # the next attempts continue it (`resumable` deployments only).
    resume: Continuation | None = None
    continued: list[str] = field(default_factory=list)  # the deployments cut mid-reply
    # The request of an attempt that failed after it was queued: the next attempt takes
    # over its idempotency key, and it can no longer be resumed.
    superseded: RequestHandle | None = None

    @classmethod
    async def start(cls, route: Route, kind: Kind, attempt: Attempt, *, redis: Any,
                    bound: int, timeout_s: float, prompt_only: bool = False,
                    trimmed: int | None = None, reply: int = 0,
                    affinity: bytes | None = None) -> Submitted:
        """Plan the call and make its first attempt that is admitted; the last refusal
        when none is (BadRequest when the call is too long for every deployment).
        `trimmed`: the call's bound once the worker dropped all the history it may drop
        (a conversation's, truncation "auto"): the deployments that hold only that are
        planned when none holds the whole call. `reply`: the max_tokens part of both,
        which a clamping deployment lowers (inference/routing.py). `affinity`: the
        call's prefix key (its targets then in that key's order)."""
        names = [t.deployment for t in (*route.targets, *route.fallbacks)]
        down = await breakers.unavailable(redis, names)
        planned: Plan = plan(route, rng=_rng, unavailable=down, prompt_bound=bound,
                             reply=reply, affinity=affinity)
        if planned.only_context and trimmed is not None and trimmed < bound:
            planned = plan(route, rng=_rng, unavailable=down, prompt_bound=trimmed,
                           reply=reply, affinity=affinity)
        if planned.only_context:
            raise BadRequest(f"The request is too long for every deployment of model "
                             f"'{route.alias}'.", code="context_length_exceeded",
                             param="messages")
        routed = cls(route.alias, kind, list(planned.order), time.monotonic() + timeout_s,
                     attempt, dict(planned.skipped), prompt_only=prompt_only,
                     clamps=route.clamps)
        sub = await routed.next(first=True)
        assert sub is not None  # noqa: S101  (first=True raises instead)
        return sub

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def described(self) -> dict[str, str]:
        """What the audit event says of the route beyond the alias (scalars: the audit
        keeps detail values small): the attempts that failed, the deployments left out."""
        out = {}
        if self.continued:
            out["fallback_from"] = ", ".join(self.continued)
        if self.failed:
            out["failed_attempts"] = ", ".join(
                f"{f['deployment']} ({f['status']} {f['code']})" for f in self.failed)
        if self.skipped:
            out["skipped"] = ", ".join(f"{name} ({why})" for name, why in self.skipped.items())
        return out

    def note(self, deployment: str, status: int, code: str) -> None:
        self.failed.append({"deployment": deployment, "status": status, "code": code})

    def resumable(self, spec: DeploymentSpec) -> bool:
        """Whether `spec` may take this call's next attempt: any deployment, or, when
        the attempt continues a reply (`resume`), an upstream one that can."""
        return self.resume is None or (
            spec.upstream is not None
            and continues(spec.upstream.dialect, prompt_only=self.prompt_only))

    async def next(self, *, first: bool = False) -> Submitted | None:
        """The next attempt that is admitted, after a backoff when one failed before;
        None when none is left, or the deadline leaves no time for it (`first`: raise
        the last refusal instead, or a 503 when the plan was empty)."""
        refusal: ApiError | None = None
        while self.order:
            name = self.order.pop(0)
            spec = await enabled_spec(name)
            if spec is None:  # disabled or removed since the alias was read
                self.note(name, 404, "model_not_found")
                continue
            if spec.kind != self.kind:
                raise BadRequest(f"The model '{self.alias}' is a {spec.kind.value} model.",
                                 code="wrong_model_kind", param="model")
            if not self.resumable(spec):
                self.skipped[name] = "cannot_continue"
                continue
            if self.failed:
                pause = backoff_s(len(self.failed), rng=_rng)
                if pause >= self.left_s():
                    break
                await asyncio.sleep(pause)
            scope = telemetry.current_scope()
            if scope is not None:
                scope.model = spec.name
            try:
                return await self.attempt(spec, self)
            except ApiError as exc:
                if not retriable_refusal(exc):
                    if first:
                        raise
                    return None
                self.note(name, exc.status, str(exc.code))
                refusal = exc
        if not first:
            return None
        if refusal is not None:
            raise refusal
        raise Unavailable(f"No deployment of model '{self.alias}' is available now; try "
                          "again shortly.", code="no_deployment_available",
                          headers={"Retry-After": "1"})

    async def fall_back(self, failed: ErrorEvent, *, deployment: str,
                        handle: RequestHandle, text: str, deltas: int,
                        next_seq: int) -> Submitted | None:
        """The call's next attempt after its attempt on `deployment` (its request
        `handle`) failed retriably with `failed`, having sent `deltas` delta events
        (`text`; the next takes sequence number `next_seq`): after text, as its
        continuation (deployments that can continue it only). None when no next
        deployment admits it within the deadline: `failed` is the call's answer (its
        audit event's own status), and the route is as it was but for `handle`, which
        is superseded."""
        before = self.resume
        if deltas:
            # Billed once: the failed attempt is not (a platform failure); the
            # continuation's final event bills these tokens as its completion's start
            # and leaves them out of its prompt (inference/upstream/client.py).
            self.resume = Continuation(
                text=text, seq=next_seq,
                completion_tokens=failed["usage"]["completion_tokens"] or deltas)
        self.note(deployment, failed["status"], failed["code"])
        this = self.failed[-1]
        self.superseded = handle
        attempt = await self.next()
        if attempt is None:
            self.failed.remove(this)
            self.resume = before
            return None
        if deltas:
            self.continued.append(deployment)
        return attempt

    async def supersede(self, idempotency_key: str | None) -> None:
        """Before an attempt after one whose queued request failed (`superseded`): the
        caller's idempotency key is freed for the new request, and the failed one is no
        longer resumable (its stream holds only the failure)."""
        handle, self.superseded = self.superseded, None
        if handle is None:
            return
        keys = [q.owner_key(handle.tenant, handle.rid)]
        if idempotency_key is not None:
            keys.append(q.idem_key(handle.tenant, idempotency_key))
        with contextlib.suppress(Exception):  # at worst a retry replays the failure
            await handle.client.redis.delete(*keys)

    def admission(self, admitted: Admission) -> RoutedAdmission:
        """`admitted` as this call's attempt (audited with the route)."""
        return RoutedAdmission(**{f.name: getattr(admitted, f.name) for f in fields(admitted)},
                               routed=self)


@dataclass
class RoutedAdmission(Admission):
    """An alias call's attempt: settled like any admission; its audit event (when it is
    the call's last attempt) names the alias and the attempts that failed before it."""

    routed: Routed | None = None

    def audit_detail(self) -> dict[str, Any]:
        routed = self.routed
        return {} if routed is None else {"alias": routed.alias, **routed.described()}


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
