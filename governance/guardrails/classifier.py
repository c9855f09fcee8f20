"""The classifier guard: a classification model, served as an ordinary deployment of
kind `classify` through the queue (batched, scaled and governed like any model), reads
each text; a text is found when a counted label's probability reaches the threshold.

Config: `deployment` (a classifier deployment's name), `threshold` (0 to 1, default
0.5). The policy's `categories` name the labels that count (default: every label that
is not benign: BENIGN). It finds, it does not rewrite: a `mask` policy blocks.

The call is made by the pipeline as the caller's (Context.classify: their limits and
quotas count it), but the policy, not the caller, chose the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from governance.guardrails.guards import Context, Guard, Verdict
from governance.guardrails.policy import Policy

# Labels that mean "nothing found" in the shipped and common classifiers (Prompt Guard
# 2's LABEL_0 / BENIGN, moderation models' safe / neutral ...), compared lower-case.
BENIGN = frozenset({"benign", "safe", "label_0", "negative", "neutral", "ok", "none",
                    "normal", "clean"})


def counted(labels: Sequence[str], only: Sequence[str] = ()) -> list[int]:
    """The indices of the labels that flag: those named in `only` (case-insensitive),
    else every label that is not benign."""
    if only:
        wanted = {c.lower() for c in only}
        return [k for k, label in enumerate(labels) if label.lower() in wanted]
    return [k for k, label in enumerate(labels) if label.lower() not in BENIGN]


class ClassifierGuard(Guard):
    def __init__(self, policy: Policy) -> None:
        self.deployment = str(policy.config.get("deployment", ""))
        self.threshold = float(policy.config.get("threshold", 0.5))
        self.only = policy.categories

    async def check(self, texts: Sequence[str], ctx: Context) -> Verdict:
        if ctx.classify is None:
            raise RuntimeError("no classifier reachable from this call")
        scores, labels = await ctx.classify(self.deployment, [t for t in texts if t] or [" "])
        worst: tuple[float, str] | None = None
        for row in scores:
            for k in counted(labels, self.only):
                if row[k] >= self.threshold and (worst is None or row[k] > worst[0]):
                    worst = (row[k], labels[k])
        if worst is None:
            return Verdict(False)
        return Verdict(True, worst[1].upper(), reason=f"{worst[1]}={worst[0]:.3f}")


def check_config(config: dict[str, Any]) -> dict[str, Any]:
    """A classifier policy's config as stored, or ValueError."""
    unknown = set(config) - {"deployment", "threshold"}
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]}: unknown (known: deployment, threshold)")
    threshold = config.get("threshold", 0.5)
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) \
            or not 0 < threshold <= 1:
        raise ValueError("threshold: a number in (0, 1]")
    return {"deployment": str(config.get("deployment") or ""), "threshold": float(threshold)}
