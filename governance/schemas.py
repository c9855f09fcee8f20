"""Management API shapes for rate limits, quotas, breakers and usage.

Every number of a policy carries its documented range (governance.ranges: the same
table the services check and the hot path clamps to), so a value outside it is a 422
naming the field; free text refuses control characters (sluice.schemas.Line)."""

from __future__ import annotations

from datetime import date, datetime
from decimal import Decimal
from typing import Annotated, Any, Literal

from ninja import Schema
from pydantic import AwareDatetime, Field, PlainSerializer, StringConstraints, WithJsonSchema

from governance import pricing
from governance.models import (
    BudgetScope,
    BudgetWindow,
    DegradeMode,
    QuotaPeriod,
    QuotaWindow,
    RateLimitScope,
    WindowKind,
)
from governance.ranges import BREAKER, BUDGET, PRICE, QUOTA, RATE_LIMIT, Range
from sluice.schemas import Id, Line, StrictSchema


def _in(bounds: Range) -> Any:
    """The pydantic constraint for one documented range: finite, within it."""
    if bounds.integer:
        return Field(ge=int(bounds.lo), le=int(bounds.hi))
    return Field(ge=bounds.lo, le=bounds.hi, allow_inf_nan=False)


ModelName = Annotated[str, StringConstraints(max_length=100, pattern=r"^[A-Za-z0-9._-]*$")]
HttpStatus = Annotated[int, Field(ge=100, le=599)]


class RateLimitFields(StrictSchema):
    name: Annotated[Line, StringConstraints(max_length=100)] | None = None
    model: ModelName | None = None
    requests_per_minute: Annotated[int, _in(RATE_LIMIT["requests_per_minute"])] | None = None
    tokens_per_minute: Annotated[int, _in(RATE_LIMIT["tokens_per_minute"])] | None = None
    burst_requests: Annotated[int, _in(RATE_LIMIT["burst_requests"])] | None = None
    burst_tokens: Annotated[int, _in(RATE_LIMIT["burst_tokens"])] | None = None
    adaptive: bool | None = None
    qps_ref: Annotated[float, _in(RATE_LIMIT["qps_ref"])] | None = None
    qps_min: Annotated[float, _in(RATE_LIMIT["qps_min"])] | None = None
    qps_max: Annotated[float, _in(RATE_LIMIT["qps_max"])] | None = None
    p99_target_ms: Annotated[float, _in(RATE_LIMIT["p99_target_ms"])] | None = None
    p99_slope: Annotated[float, _in(RATE_LIMIT["p99_slope"])] | None = None
    floor: Annotated[float, _in(RATE_LIMIT["floor"])] | None = None
    window_s: Annotated[int, _in(RATE_LIMIT["window_s"])] | None = None
    fail_open: bool | None = None


class RateLimitCreateIn(RateLimitFields):
    scope: RateLimitScope
    tenant_id: Id | None = None  # None: the platform default (platform admins)
    api_key_id: Id | None = None


class RateLimitOut(Schema):
    id: int
    name: str
    scope: RateLimitScope
    tenant_id: int | None
    api_key_id: int | None
    model: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    burst_requests: int | None
    burst_tokens: int | None
    adaptive: bool
    qps_ref: float
    qps_min: float
    qps_max: float
    p99_target_ms: float
    p99_slope: float
    floor: float
    window_s: int
    fail_open: bool
    created_at: datetime


class RateLimitDetailOut(RateLimitOut):
    effective: list[dict[str, Any]] = Field(
        description="Per model: the adaptive factor now, its inputs and the limits it gives.")


class QuotaFields(StrictSchema):
    model: ModelName | None = None
    period: QuotaPeriod | None = None
    window: QuotaWindow | None = None
    max_requests: Annotated[int, _in(QUOTA["max_requests"])] | None = None
    max_tokens: Annotated[int, _in(QUOTA["max_tokens"])] | None = None
    max_concurrent: Annotated[int, _in(QUOTA["max_concurrent"])] | None = None
    shadow: bool | None = None


class QuotaCreateIn(QuotaFields):
    tenant_id: Id


class QuotaOut(Schema):
    id: int
    tenant_id: int
    model: str
    period: QuotaPeriod
    window: QuotaWindow
    max_requests: int | None
    max_tokens: int | None
    max_concurrent: int | None
    shadow: bool
    created_at: datetime


class QuotaUseOut(Schema):
    requests: int
    tokens: int
    open_reservations: int
    reserved_tokens: int
    resets_at: datetime


class QuotaDetailOut(QuotaOut):
    usage: QuotaUseOut


class BreakerFields(StrictSchema):
    window_kind: WindowKind | None = None
    window_size: Annotated[int, _in(BREAKER["window_size"])] | None = None
    min_calls: Annotated[int, _in(BREAKER["min_calls"])] | None = None
    failure_rate: Annotated[float, _in(BREAKER["failure_rate"])] | None = None
    slow_call_ms: Annotated[int, _in(BREAKER["slow_call_ms"])] | None = None
    slow_call_rate: Annotated[float, _in(BREAKER["slow_call_rate"])] | None = None
    open_wait_s: Annotated[float, _in(BREAKER["open_wait_s"])] | None = None
    half_open_probes: Annotated[int, _in(BREAKER["half_open_probes"])] | None = None
    probe_timeout_s: Annotated[float, _in(BREAKER["probe_timeout_s"])] | None = None
    memory_high: Annotated[float, _in(BREAKER["memory_high"])] | None = None
    memory_low: Annotated[float, _in(BREAKER["memory_low"])] | None = None
    memory_hold_s: Annotated[float, _in(BREAKER["memory_hold_s"])] | None = None
    degrade_mode: DegradeMode | None = None
    degraded_max_tokens: Annotated[int, _in(BREAKER["degraded_max_tokens"])] | None = None
    shed_queue_depth: Annotated[int, _in(BREAKER["shed_queue_depth"])] | None = None
    shed_oldest_age_ms: Annotated[int, _in(BREAKER["shed_oldest_age_ms"])] | None = None
    priority_share: Annotated[float, _in(BREAKER["priority_share"])] | None = None


class BreakerOut(Schema):
    deployment: str
    window_kind: WindowKind
    window_size: int
    min_calls: int
    failure_rate: float
    slow_call_ms: int
    slow_call_rate: float
    open_wait_s: float
    half_open_probes: int
    probe_timeout_s: float
    memory_high: float
    memory_low: float
    memory_hold_s: float
    degrade_mode: DegradeMode
    degraded_max_tokens: int
    shed_queue_depth: int | None
    shed_oldest_age_ms: int | None
    priority_share: float
    live: dict[str, Any]


def _usd(bounds: Range, places: int = 6) -> Any:
    """A price: a decimal in dollars within its range, at most `places` decimals (a JSON
    number or a string; never read through a float's error: "0.1" is 0.1). The OpenAPI
    document states both forms, the string's by its pattern."""
    return (Field(ge=Decimal(bounds.lo), le=Decimal(bounds.hi), decimal_places=places,
                  allow_inf_nan=False),
            WithJsonSchema({"anyOf": [
                {"type": "number", "minimum": bounds.lo, "maximum": bounds.hi},
                {"type": "string", "pattern": rf"^[0-9]+(\.[0-9]{{1,{places}}})?$"}]}))


class PriceIn(StrictSchema):
    model: Annotated[str, StringConstraints(min_length=1, max_length=100,
                                            pattern=r"^[A-Za-z0-9._-]+$")]
    input_per_mtok_usd: Annotated[Decimal, *_usd(PRICE["input_per_mtok_usd"])]
    output_per_mtok_usd: Annotated[Decimal, *_usd(PRICE["output_per_mtok_usd"])]
    cached_input_per_mtok_usd: Annotated[
        Decimal, *_usd(PRICE["cached_input_per_mtok_usd"])] | None = None
    gpu_second_usd: Annotated[Decimal, *_usd(PRICE["gpu_second_usd"], 9)] | None = None
    valid_from: AwareDatetime | None = None  # default: now


# A price out: its exact decimal as a string, without trailing zeros ("0.15", "10").
Usd = Annotated[Decimal, PlainSerializer(lambda d: format(d.normalize(), "f"), return_type=str)]


class PriceOut(Schema):
    id: int
    model: str
    input_per_mtok_usd: Usd
    output_per_mtok_usd: Usd
    cached_input_per_mtok_usd: Usd | None
    gpu_second_usd: Usd | None
    valid_from: datetime
    created_at: datetime


AlertAt = Annotated[list[Annotated[int, Field(ge=1, le=100)]], Field(max_length=10)]


class BudgetFields(StrictSchema):
    limit_usd: Annotated[Decimal, *_usd(BUDGET["limit_usd"])] | None = None
    alert_at: AlertAt | None = None  # percentages of limit_usd, each alerting once a window
    fallback_model: ModelName | None = None  # "": none


class BudgetCreateIn(StrictSchema):
    tenant_id: Id | None = None  # default: the caller's
    scope: BudgetScope = BudgetScope.TENANT
    member_id: Id | None = None
    key_id: Id | None = None
    model: ModelName = ""
    window: BudgetWindow = BudgetWindow.MONTH
    limit_usd: Annotated[Decimal, *_usd(BUDGET["limit_usd"])]
    alert_at: AlertAt = Field(default_factory=lambda: [50, 80, 100])
    fallback_model: ModelName = ""


class BudgetOut(Schema):
    id: int
    tenant_id: int
    scope: BudgetScope
    member_id: int | None
    key_id: int | None = Field(None, validation_alias="api_key_id")
    model: str
    window: BudgetWindow
    limit_usd: Usd
    alert_at: list[int]
    fallback_model: str
    created_at: datetime


class BudgetUseOut(Schema):
    spent_usd: str  # settled in the current window
    held_usd: str  # reserved by calls still running (their worst case)
    resets_at: datetime | None  # None: a `total` budget
    alerted_pct: int  # the highest alert threshold reached in this window (0: none)


class BudgetDetailOut(BudgetOut):
    usage: BudgetUseOut


class UsageOut(Schema):
    tenant_id: int
    model: str
    key_prefix: str
    day: date
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: str  # exact, at the prices valid when each call was admitted
    updated_at: datetime

    @staticmethod
    def resolve_cost_usd(row: Any) -> str:
        return pricing.usd(row.cost_nanousd)


class AuditEventOut(Schema):
    id: int
    chain: str
    seq: int
    at: datetime
    tenant_id: int | None
    actor: str
    role: str
    key_prefix: str
    action: str
    target: str
    model: str
    protocol: str
    status: int
    latency_ms: float
    prompt_tokens: int
    completion_tokens: int
    request_id: str
    trace_id: str
    request_excerpt: str
    response_excerpt: str
    detail: dict[str, Any]
    hash: str


class AuditExportIn(StrictSchema):
    format: Literal["jsonl", "csv"] = "jsonl"
    tenant_id: Id | None = None
    since: datetime | None = None
    until: datetime | None = None
    actor: Annotated[Line, StringConstraints(max_length=300)] | None = None
    model: ModelName | None = None
    status: HttpStatus | None = None
    action: Annotated[Line, StringConstraints(max_length=64)] | None = None


class AuditExportOut(Schema):
    id: int
    tenant_id: int | None
    format: str
    filters: dict[str, Any]
    status: str
    total: int
    done: int
    error: str
    created_at: datetime
    finished_at: datetime | None


class RedactionPatternIn(StrictSchema):
    label: Annotated[str, StringConstraints(pattern=r"^[A-Z][A-Z0-9_]{0,31}$")]
    pattern: Annotated[Line, StringConstraints(min_length=1, max_length=200)]


class RedactionPatternOut(Schema):
    id: int
    label: str
    pattern: str
    created_at: datetime


class BillingOut(Schema):
    tenant_id: int
    time_zone: str  # where the budgets' days, weeks and months begin
    webhook_url: str | None  # where budget alerts are POSTed, signed
    webhook_secret_hint: str | None  # the secret's last four characters
    webhook_secret: str | None = None  # in the reply that made it only


class BillingIn(StrictSchema):
    time_zone: Annotated[str, StringConstraints(
        max_length=64, pattern=r"^[A-Za-z0-9_+/-]*$")] | None = None  # an IANA name
    webhook_url: Annotated[str, StringConstraints(
        max_length=2048, pattern=r"^[\x21-\x7e]*$")] | None = None  # None: no webhook
    webhook_secret: Annotated[str, StringConstraints(
        max_length=200, pattern=r"^[\x21-\x7e]*$")] | None = None  # default: one made


class SpendQuery(Schema):
    since: datetime | None = Field(None, alias="from")  # default: 30 days ago; no zone: UTC
    until: datetime | None = Field(None, alias="to")  # default: now
    granularity: Literal["hour", "day"] = "day"
    group_by: Literal["key", "member", "model"] | None = None
    tenant_id: Id | None = None  # platform admins: another tenant's
    latency: bool = False  # p50/p95 too (reads every row's histogram: slower)


class SpendRowOut(Schema):
    start: datetime  # the period's start (UTC hour, or the tenant's local midnight)
    key_prefix: str | None = None  # with group_by=key
    member_id: int | None = None  # with group_by=member (None: calls with no member)
    model: str | None = None  # with group_by=model
    calls: int
    errors: int  # status 400 and above, refusals included
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_usd: str  # exact, at the prices valid when each call was admitted
    latency_p50_ms: float | None = None
    latency_p95_ms: float | None = None
