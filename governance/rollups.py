"""Spend and usage history: the audit log's call events rolled into hourly rows (UTC
hours) and daily rows (calendar days in the tenant's time zone) per tenant, member, API
key and model, by Celery beat (governance.tasks.spend_rollup, every
SLUICE_SPEND_ROLLUP_S); `spend` reads them for the API and the UI.

Why the audit log: it holds one event per call, refusals included, with who made it,
the key, the model, the status, the latency, the tokens and the cost at the prices of
the call's admission, stored once however often it was delivered
(governance/audit.py). A run recomputes whole periods and replaces their rows, so two
runs, two workers or a late run give the same rows; the events of an hour that arrive
late (the audit writer lags by seconds) are counted by the next run, which covers the
last LOOKBACK_H hours. A zone whose offset is not whole hours (India's, Nepal's) gets
days cut at the hour boundary nearest its midnight.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, TypeVar
from zoneinfo import ZoneInfo

from django.db import transaction
from django.db.models import Sum
from django.db.models.fields.json import KeyTextTransform
from django.utils import timezone

from governance import pricing, signals
from governance.models import AuditEvent
from governance.rollup_models import Rollup, UsageDay, UsageHour
from tenants.models import Tenant

LOOKBACK_H = 3
HOUR, DAY = "hour", "day"
GROUPS = {"key": "key_prefix", "member": "member_id", "model": "model"}
_NOT_CALLS = ("admin", "internal")  # audit protocols of admin actions and alerts
_MEMBER = re.compile(r"member:(\d+)")
R = TypeVar("R", bound=Rollup)


@dataclass
class _Sums:
    calls: int = 0
    errors: int = 0
    prompt: int = 0
    completion: int = 0
    cached: int = 0
    cost: int = 0
    hist: dict[str, int] = field(default_factory=dict)

    def add_call(self, status: int, latency_ms: float, prompt: int, completion: int,
                 cost: int, cached: int = 0) -> None:
        self.calls += 1
        self.errors += status >= 400
        self.prompt, self.completion = self.prompt + prompt, self.completion + completion
        self.cached += cached
        self.cost += cost
        bucket = str(signals.bucket_of(latency_ms))
        self.hist[bucket] = self.hist.get(bucket, 0) + 1

    def add_row(self, row: Rollup) -> None:
        self.calls, self.errors = self.calls + row.calls, self.errors + row.errors
        self.prompt += row.prompt_tokens
        self.completion += row.completion_tokens
        self.cached += row.cached_tokens
        self.cost += row.cost_nanousd
        merge(self.hist, row.latency_hist)

    def row(self, model: type[R], start: datetime, key: tuple[Any, ...]) -> R:
        tenant_id, member_id, prefix, name = key
        return model(start=start, tenant_id=tenant_id, member_id=member_id, key_prefix=prefix,
                     model=name, calls=self.calls, errors=self.errors,
                     prompt_tokens=self.prompt, completion_tokens=self.completion,
                     cached_tokens=self.cached, cost_nanousd=self.cost,
                     latency_hist=self.hist)


def merge(into: dict[str, int], hist: dict[str, int]) -> dict[str, int]:
    for bucket, count in hist.items():
        into[bucket] = into.get(bucket, 0) + count
    return into


def percentile(hist: dict[str, int], q: float) -> float | None:
    """The `q` quantile (0-1) of a latency histogram, as its bucket's upper bound (ms)."""
    total = sum(hist.values())
    if not total:
        return None
    seen = 0
    for bucket in sorted(hist, key=int):
        seen += hist[bucket]
        if seen >= q * total:
            return round(signals.upper_ms(int(bucket)), 1)
    return None


def _count(value: str | None) -> int:
    """A count the audit's detail holds as text (0 when absent or not a count)."""
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


def _nanos(cost: str | None) -> int:
    try:
        return int(Decimal(cost or 0) * pricing.NANO_PER_USD)
    except ArithmeticError:
        return 0


def _hour_rows(start: datetime) -> list[UsageHour]:
    events = (AuditEvent.objects.filter(at__gte=start, at__lt=start + timedelta(hours=1),
                                        tenant__isnull=False)
              .exclude(model="").exclude(protocol__in=_NOT_CALLS)
              .annotate(cost=KeyTextTransform("cost_usd", "detail"),
                        cached=KeyTextTransform("cached_tokens", "detail"))
              .values_list("tenant_id", "actor", "key_prefix", "model", "status",
                           "latency_ms", "prompt_tokens", "completion_tokens", "cost",
                           "cached"))
    groups: dict[tuple[Any, ...], _Sums] = {}
    for tenant_id, actor, prefix, model, status, ms, prompt, completion, cost, cached in \
            events.iterator(chunk_size=5000):
        member = _MEMBER.fullmatch(actor or "")
        key = (tenant_id, int(member.group(1)) if member else None, prefix, model)
        groups.setdefault(key, _Sums()).add_call(status, ms, prompt, completion, _nanos(cost),
                                                 _count(cached))
    return [sums.row(UsageHour, start, key) for key, sums in groups.items()]


def _local_day(at: datetime, zone: str) -> tuple[datetime, datetime]:
    local = timezone.localtime(at, ZoneInfo(zone))
    midnight = local.replace(hour=0, minute=0, second=0, microsecond=0)
    return midnight, midnight + timedelta(days=1)


@transaction.atomic
def _roll_days(tenant: Tenant, hours: Iterable[datetime]) -> int:
    days = {_local_day(h, tenant.time_zone) for h in hours}
    written = 0
    for day_start, day_stop in days:
        groups: dict[tuple[Any, ...], _Sums] = {}
        for row in UsageHour.objects.filter(tenant=tenant, start__gte=day_start,
                                            start__lt=day_stop):
            key = (tenant.pk, row.member_id, row.key_prefix, row.model)
            groups.setdefault(key, _Sums()).add_row(row)
        UsageDay.objects.filter(tenant=tenant, start=day_start).delete()
        UsageDay.objects.bulk_create([s.row(UsageDay, day_start, k) for k, s in groups.items()],
                                     batch_size=1000)
        written += len(groups)
    return written


def roll(*, now: datetime | None = None, hours: int = LOOKBACK_H) -> int:
    """Recompute the last `hours` UTC hours (the current one included) and the days
    they fall in, for every tenant with calls in them then or now. Returns rows written."""
    last = (now or timezone.now()).replace(minute=0, second=0, microsecond=0)
    starts = [last - timedelta(hours=i) for i in range(hours)]
    written = 0
    tenants: set[int] = set()
    for start in starts:
        rows = _hour_rows(start)
        with transaction.atomic():
            stale = UsageHour.objects.filter(start=start)
            tenants.update(stale.values_list("tenant_id", flat=True).distinct())
            stale.delete()
            UsageHour.objects.bulk_create(rows, batch_size=1000)
        tenants.update(r.tenant_id for r in rows)
        written += len(rows)
    for tenant in Tenant.objects.filter(pk__in=tenants):
        written += _roll_days(tenant, starts)
    return written


def spend(*, tenant_id: int, granularity: str, start: datetime, stop: datetime,
          group_by: str | None = None, key_prefixes: list[str] | None = None,
          latency: bool = False, per_period: bool = True) -> list[dict[str, Any]]:
    """The tenant's rollups of the periods that overlap [start, stop), per period (and
    per `group_by`: "key", "member" or "model"), oldest first: calls, errors, tokens,
    cost (exact), and with `latency` the p50/p95 of the calls' latencies (from the
    rows' histograms; the one part that reads every row). `key_prefixes`: only these
    keys' calls. Without `per_period`, one row per group for the whole range (its
    `start`: the range's first period)."""
    model, period = ((UsageHour, timedelta(hours=1)) if granularity == HOUR
                     else (UsageDay, timedelta(days=1)))
    rows = model.objects.filter(tenant_id=tenant_id, start__gt=start - period, start__lt=stop)
    if key_prefixes is not None:
        rows = rows.filter(key_prefix__in=key_prefixes)
    by = [*(["start"] if per_period else []), *([GROUPS[group_by]] if group_by else [])]
    sums = {"calls": Sum("calls"), "errors": Sum("errors"),
            "prompt_tokens": Sum("prompt_tokens"),
            "completion_tokens": Sum("completion_tokens"),
            "cached_tokens": Sum("cached_tokens"), "cost": Sum("cost_nanousd")}
    found = (list(rows.values(*by).annotate(**sums).order_by(*by)) if by
             else [{k: v or 0 for k, v in rows.aggregate(**sums).items()}])
    out = [{"start": start, **r, "cost_usd": pricing.usd(r.pop("cost"))} for r in found]
    if latency:
        hists: dict[tuple[Any, ...], dict[str, int]] = {}
        for values in rows.values_list(*by, "latency_hist").iterator(chunk_size=5000):
            merge(hists.setdefault(tuple(values[:-1]), {}), values[-1])
        for r in out:
            hist = hists.get(tuple(r[f] for f in by), {})
            r["latency_p50_ms"] = percentile(hist, 0.5)
            r["latency_p95_ms"] = percentile(hist, 0.95)
    return out
