"""The refusals of a quota or budget that cannot take a call: RESERVE_LUA's reply read
(governance/quota.py), and the error every API renders from it (sluice.errors: a 429
with the quota's or budget's details and when it resets)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from governance import pricing
from governance.models import Budget
from governance.quota import Metered
from sluice.errors import BudgetExceeded, QuotaExceeded

# Names the model a budget's fallback sent a call to (the reply keeps the name asked for).
FALLBACK_HEADER = "x-sluice-fallback-model"


@dataclass(frozen=True)
class Refusal:
    quota: Metered
    metric: str  # "requests" | "tokens" | "concurrent"
    limit: int
    used: int
    resets_at: int | None  # epoch seconds; None for concurrency

    def message(self, model: str) -> str:
        what = {"requests": "requests", "tokens": "tokens",
                "concurrent": "concurrent requests"}[self.metric]
        scope = f"model '{model}'" if self.quota.model else "all models"
        if self.metric == "concurrent":
            return (f"Quota exceeded: at most {self.limit} {what} at once for {scope}; "
                    f"{self.used} are running.")
        when = datetime.fromtimestamp(self.resets_at or 0, UTC).isoformat()
        period = self.quota.window if isinstance(self.quota, Budget) else self.quota.period
        return (f"Quota exceeded: {what} per {period} for {scope} is "
                f"{self.limit}; {self.used} used or reserved. It resets at {when}.")


def refusal(quotas: Sequence[Metered], reply: list[Any]) -> Refusal:
    metric = reply[2].decode() if isinstance(reply[2], bytes) else str(reply[2])
    return Refusal(quota=quotas[int(reply[1])], metric=metric, limit=int(reply[3]),
                   used=int(reply[4]),
                   resets_at=None if metric == "concurrent" else int(reply[5]))


def shadow_hits(quotas: Sequence[Metered], reply: list[Any]) -> list[tuple[Metered, str]]:
    out = []
    for raw in reply[1:]:
        index, _, metric = (raw.decode() if isinstance(raw, bytes) else str(raw)).partition(":")
        out.append((quotas[int(index)], metric))
    return out


def over_quota(refused: Refusal, model: str) -> QuotaExceeded:
    """`refused` (a call of `model`) as its error: which quota or budget, its limit,
    what is used, when it resets."""
    if isinstance(refused.quota, Budget):
        return over_budget(refused.quota, refused)
    wait = (refused.resets_at - time.time()) if refused.resets_at else 1.0
    details = {"quota": {
        "id": refused.quota.pk, "model": refused.quota.model or None,
        "metric": refused.metric, "period": refused.quota.period,
        "window": refused.quota.window, "limit": refused.limit, "used": refused.used,
        "resets_at": (datetime.fromtimestamp(refused.resets_at, UTC).isoformat()
                      if refused.resets_at else None)}}
    return QuotaExceeded(refused.message(model), retry_after_s=max(1.0, wait),
                         details=details)


def over_budget(budget: Budget, refused: Refusal) -> BudgetExceeded:
    """A budget's refusal: which budget, what it allows, what is spent or held, and when
    its window resets (a `total` never does: no Retry-After worth waiting for)."""
    limit, spent = pricing.usd(refused.limit), pricing.usd(refused.used)
    whose = {"tenant": "the tenant", "member": "this member", "key": "this API key"}.get(
        budget.scope, budget.scope)
    scope = f"model '{budget.model}'" if budget.model else "all models"
    resets = (datetime.fromtimestamp(refused.resets_at, UTC).isoformat()
              if refused.resets_at else None)
    when = f" It resets at {resets}." if resets else " It does not reset."
    refused_call = BudgetExceeded(
        f"Budget exceeded: {whose} may spend ${limit} per {budget.window} on {scope}; "
        f"${spent} is spent or held by running calls, and this call could cost more than "
        f"is left.{when}",
        retry_after_s=max(1.0, (refused.resets_at or 0) - time.time()),
        headers={"x-should-retry": "false"} if resets is None else None,
        details={"budget": {"id": budget.pk, "scope": budget.scope,
                            "model": budget.model or None, "window": budget.window,
                            "limit_usd": limit, "spent_usd": spent, "resets_at": resets}})
    refused_call.fallback_model = budget.fallback_model
    return refused_call
