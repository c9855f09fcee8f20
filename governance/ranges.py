"""The documented range of every number of a governance policy (docs/GOVERNANCE.md,
"Ranges"), written once and used three ways:

- the management API's schemas declare each range (governance.schemas): a value outside
  it, or not finite, is a 422 naming the field, and the OpenAPI document states it;
- `check(row)` refuses the same on every write, whatever the edge (API, admin UI);
- `sane(row)` is how the hot path reads a stored policy (governance.cache): a number
  outside its range (a row written before the check existed, or straight into the
  database) is read as the nearest bound, a NaN or an unknown choice as the field's
  default, and the repair is logged. No stored policy can make a call fail.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TypeVar

from django.db import models

from governance.models import BreakerPolicy, Budget, Price, Quota, RateLimitPolicy
from sluice.errors import Unprocessable

logger = logging.getLogger("sluice.governance")
M = TypeVar("M", bound=models.Model)


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    integer: bool = False


def _ints(lo: int, hi: int) -> Range:
    return Range(lo, hi, integer=True)


PER_MINUTE_MAX = 1_000_000_000
# The adaptive factor's ceiling (qps_max's): the effective rate is at most 100x the base.
FACTOR_MAX = 100.0

RATE_LIMIT: dict[str, Range] = {
    "requests_per_minute": _ints(1, PER_MINUTE_MAX),
    "tokens_per_minute": _ints(1, PER_MINUTE_MAX),
    "burst_requests": _ints(1, PER_MINUTE_MAX),
    "burst_tokens": _ints(1, PER_MINUTE_MAX),
    "qps_ref": Range(0.001, 1_000_000.0),
    "qps_min": Range(0.0, FACTOR_MAX),
    "qps_max": Range(0.0, FACTOR_MAX),
    "p99_target_ms": Range(0.0, 3_600_000.0),
    "p99_slope": Range(0.0, 100.0),
    "floor": Range(0.0, 1.0),
    "window_s": _ints(1, 3600),
}
QUOTA: dict[str, Range] = {
    # Lua numbers are doubles: counts stay exact up to 2**53 (~9e15).
    "max_requests": _ints(1, 10**15),
    "max_tokens": _ints(1, 10**15),
    "max_concurrent": _ints(1, 1_000_000),
}
BREAKER: dict[str, Range] = {
    "window_size": _ints(1, 10_000),
    "min_calls": _ints(1, 1_000_000),
    "failure_rate": Range(0.0, 1.0),
    "slow_call_ms": _ints(1, 3_600_000),
    "slow_call_rate": Range(0.0, 1.0),
    "open_wait_s": Range(0.01, 86_400.0),
    "half_open_probes": _ints(1, 1000),
    "probe_timeout_s": Range(0.01, 3600.0),
    "memory_high": Range(0.0, 1.0),
    "memory_low": Range(0.0, 1.0),
    "memory_hold_s": Range(0.0, 3600.0),
    "degraded_max_tokens": _ints(1, 1_048_576),
    "shed_queue_depth": _ints(1, 1_000_000),
    "shed_oldest_age_ms": _ints(1, 3_600_000),
    "priority_share": Range(0.0, 1.0),
}
# US dollars. A price's decimals are exact (governance.pricing); its bounds refuse
# typos (a price per token entered as per million) more than they bound arithmetic.
PRICE_PER_MTOK_MAX = 100_000
PRICE: dict[str, Range] = {
    "input_per_mtok_usd": Range(0, PRICE_PER_MTOK_MAX),
    "output_per_mtok_usd": Range(0, PRICE_PER_MTOK_MAX),
    "cached_input_per_mtok_usd": Range(0, PRICE_PER_MTOK_MAX),
    "gpu_second_usd": Range(0, 1_000),
}
# Redis meters a budget in nano-dollars, exactly up to 2**53 (about 9 million dollars).
BUDGET: dict[str, Range] = {"limit_usd": Range(0, 1_000_000)}
TABLES: dict[type[models.Model], dict[str, Range]] = {
    RateLimitPolicy: RATE_LIMIT, Quota: QUOTA, BreakerPolicy: BREAKER, Price: PRICE,
    Budget: BUDGET}


def _number(value: Any) -> float | None:
    """`value` as a finite number, or None (NaN, infinity, not a number at all)."""
    if isinstance(value, Decimal):
        return float(value) if value.is_finite() else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def check(row: models.Model) -> None:
    """Refuse (422 naming the field) a policy with a number outside its range; rows of
    other models pass."""
    for name, bounds in TABLES.get(type(row), {}).items():
        value = getattr(row, name)
        if value is None:
            continue
        number = _number(value)
        if number is None or not bounds.lo <= number <= bounds.hi:
            lo, hi = ((int(bounds.lo), int(bounds.hi)) if bounds.integer
                      else (bounds.lo, bounds.hi))
            raise Unprocessable(f"{name}: must be a number from {lo} to {hi}.", param=name)


def sane(row: M) -> M:
    """The stored policy `row`, repaired in place to what the API could have saved: each
    number clamped into its range (NaN: the field's default), each unknown choice its
    default. Returns `row`."""
    fields = {field.name: field for field in row._meta.concrete_fields}
    for field in fields.values():
        if field.choices and field.has_default():
            value = getattr(row, field.attname)
            if value not in {choice for choice, _label in field.flatchoices}:
                _repair(row, field.attname, value, field.get_default())
    for name, bounds in TABLES[type(row)].items():
        value = getattr(row, name)
        if value is None:  # "off" where the field allows it
            continue
        number = _number(value)
        if number is None:
            if isinstance(value, float) and math.isinf(value):
                number = bounds.hi if value > 0 else bounds.lo
            else:
                _repair(row, name, value, fields[name].get_default())
                continue
        fixed: float = min(max(number, bounds.lo), bounds.hi)
        if fixed != value:
            _repair(row, name, value, int(fixed) if bounds.integer else fixed)
    return row


def _repair(row: models.Model, name: str, value: Any, fixed: Any) -> None:
    logger.warning("%s %s: stored %s=%r is not a value it may have; read as %r",
                   type(row).__name__, row.pk, name, value, fixed)
    setattr(row, name, fixed)
