"""The refusals of a quota or budget that cannot take a call, in the shape every API
renders (sluice.errors: a 429 with the quota's or budget's details and when it resets)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from governance import pricing, quota
from governance.models import Budget
from sluice.errors import BudgetExceeded, QuotaExceeded

# Names the model a budget's fallback sent a call to (the reply keeps the name asked for).
FALLBACK_HEADER = "x-sluice-fallback-model"


def over_quota(refused: quota.Refusal, model: str) -> QuotaExceeded:
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


def over_budget(budget: Budget, refused: quota.Refusal) -> BudgetExceeded:
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
