"""One phase's rules run over a call's texts: what each policy's action, shadow mode,
timeout and failure mode make of its guard's verdict.

For each rule in order (mandatory platform policies first, then by id):
- a span guard runs inline (linear, no I/O); any other under its policy's timeout;
- a guard that fails (raises, times out, answers what it may not) is an `error`: with
  `on_error` "closed" the call is blocked (`Blocked`, reason "error"), with "open" it
  goes on; a shadow policy's failure never blocks;
- a verdict that found something: `shadow` notes what the action would have done and
  changes nothing; `flag` notes it; `mask` replaces what was found (a span guard's
  spans become `[CATEGORY]`; a rewriting guard's texts replace the texts; a guard that
  only says "blocked" cannot mask, so the call is blocked); `block` raises `Blocked`.
The next rule sees the texts as the previous ones left them.

`Verdicts` keeps, per policy and phase, the strongest outcome and the time taken,
which the call's audit event carries (`detail.guardrails`, never the text found), and
counts every check in the metrics (sluice_guardrail_verdicts, _duration_seconds).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from governance.guardrails.guards import Context, Finding, Verdict
from governance.guardrails.policy import Policy, Rule
from sluice.observability import metrics

_STRENGTH = {"allow": 0, "error": 1, "shadow": 2, "flag": 3, "mask": 4, "block": 5}


class Blocked(Exception):
    """A policy blocks the call (`why`: "found" or "error")."""

    def __init__(self, policy: Policy, why: str = "found", category: str = "") -> None:
        super().__init__(policy.name)
        self.policy, self.why, self.category = policy, why, category


class Verdicts:
    """A call's guardrail outcomes so far, for its audit event."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], list[object]] = {}

    def note(self, policy: Policy, phase: str, outcome: str, seconds: float,
             category: str = "") -> None:
        metrics.observe_guard(policy.guard, phase, outcome, seconds)
        key = (policy.name, phase)
        seen = self._seen.get(key)
        if seen is None:
            self._seen[key] = [outcome, seconds, category]
            return
        if _STRENGTH[outcome] > _STRENGTH[str(seen[0])]:
            seen[0], seen[2] = outcome, category or seen[2]
        seen[1] = float(seen[1]) + seconds  # type: ignore[arg-type]

    def summary(self) -> str:
        """`policy/phase=outcome[:CATEGORY]@ms` per policy and phase, `; `-joined."""
        return "; ".join(
            f"{name}/{phase}={outcome}{':' + str(category) if category else ''}"
            f"@{float(seconds) * 1000:.2f}ms"  # type: ignore[arg-type]
            for (name, phase), (outcome, seconds, category) in self._seen.items())

    def __bool__(self) -> bool:
        return bool(self._seen)


async def run(rules: Sequence[Rule], texts: list[str], ctx: Context,
              verdicts: Verdicts) -> list[str]:
    """`texts` after `rules` (see the module's docstring); raises Blocked."""
    for rule in rules:
        policy, guard = rule
        began = time.perf_counter()
        try:
            if guard.spans:
                verdict = guard.verdict(texts)
            else:
                async with asyncio.timeout(policy.timeout_s):
                    verdict = await guard.check(texts, ctx)
        except Exception:
            verdicts.note(policy, ctx.phase, "error", time.perf_counter() - began)
            if policy.on_error == "closed" and not policy.shadow:
                raise Blocked(policy, "error") from None
            continue
        took = time.perf_counter() - began
        if not verdict.found:
            verdicts.note(policy, ctx.phase, "allow", took)
            continue
        outcome = decided(policy, verdict)
        verdicts.note(policy, ctx.phase, outcome, took, verdict.category)
        if outcome == "block":
            raise Blocked(policy, "found", verdict.category)
        if outcome == "mask":
            texts = masked(texts, verdict)
    return texts


def decided(policy: Policy, verdict: Verdict) -> str:
    """What a policy does about a verdict that found something."""
    if policy.shadow:
        return "shadow"
    if policy.action == "mask" and verdict.spans is None and verdict.texts is None:
        return "block"  # nothing to mask with
    return policy.action


def masked(texts: list[str], verdict: Verdict) -> list[str]:
    if verdict.texts is not None:
        return list(verdict.texts)
    spans = verdict.spans or ((),) * len(texts)
    return [mask(text, found) for text, found in zip(texts, spans, strict=True)]


def mask(text: str, spans: Sequence[Finding]) -> str:
    """`text` with each (sorted, disjoint) span replaced by `[CATEGORY]`."""
    if not spans:
        return text
    out, last = [], 0
    for start, end, category in spans:
        if start < last:
            start = last
        if end <= start:
            continue
        out.append(text[last:start])
        out.append(f"[{category}]")
        last = end
    out.append(text[last:])
    return "".join(out)
