"""A reply's text under post-call rules, released as it is checked: nothing a later
verdict would mask or block ever leaves.

    held = Held(rules, ctx, verdicts, window=128)
    out = await held.feed(delta_text)   # what may be sent now ("" while held)
    out = await held.end()              # the rest, at the reply's end
    # either raises Blocked: send nothing more (the reply stops: content_filter)

The last `window` characters are held. At each feed the span guards (pii, words) scan
the held text (with a few released characters before it, for their boundaries) and
the part older than the window is released, except that:
- a match that starts before the release point is decided whole: masked (`[CATEGORY]`)
  or blocked before any of it leaves, and the release point moves to its end, so no
  match is ever split between two releases;
- a match that reaches the held text's end may still grow (an e-mail address or a key
  being written): the release point stops at its start, until it is 8 windows long,
  after which it is masked as it stands.
So a string no longer than the window is found exactly as a scan of the whole reply
would find it, however the model splits it into tokens; a longer one (a match that
starts more than a window before it can first be seen) may have released a prefix,
which is why the window must be at least the longest string a policy must catch
(docs/GUARDRAILS.md). Guards that are not span guards (the webhook) check each chunk
before it is released, in chunks of at least a window, so each sees whole windows, not
tokens (and the first token waits for up to two windows).

Time to first token is delayed by at most the window (or two, with a webhook): text is
released as soon as the window fills, not at the reply's end. A reply answered in one
piece (`stream` False) is checked once, whole, at its end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from governance.guardrails.guards import Context, Finding, Verdict
from governance.guardrails.policy import Rule
from governance.guardrails.runner import Blocked, Verdicts, decided, mask, run

CONTEXT = 32  # released characters the span guards see before the held text
GROWTH = 8  # windows a still-growing match may hold the stream


class Held:
    def __init__(self, rules: Sequence[Rule], ctx: Context, verdicts: Verdicts, *,
                 window: int, stream: bool = True) -> None:
        self._spans = [r for r in rules if r.guard.spans]
        self._others = [r for r in rules if not r.guard.spans]
        self._ctx, self._verdicts = ctx, verdicts
        self._window, self._stream = window, stream
        self._held = ""
        self._before = ""  # the last CONTEXT released characters, as generated

    async def feed(self, text: str) -> str:
        self._held += text
        if not self._stream or len(self._held) <= self._window:
            return ""
        return await self._release(final=False)

    async def end(self) -> str:
        if not self._held:
            return ""
        return await self._release(final=True)

    async def _release(self, *, final: bool) -> str:
        held, window = self._held, self._window
        n = len(held)
        point = n if final else n - window
        if self._others and not final and point < window:
            return ""  # a webhook sees whole windows
        found = self._scan(held)
        if not final:  # a match that may still grow holds the release point at its start
            for _rule, f in found:
                if f.end >= n and f.start < point and f.end - f.start < GROWTH * window:
                    point = f.start
        masks: list[Finding] = []
        done: set[int] = set()
        moved = True
        while moved:  # a mask that moves the release point may bring others before it
            moved = False
            for k, (rule, f) in enumerate(found):
                if k in done or f.start >= point:
                    continue  # still held: decided at a later release
                done.add(k)
                outcome = decided(rule.policy, Verdict(True, f.category, spans=((f,),)))
                self._verdicts.note(rule.policy, "post", outcome, 0.0, f.category)
                if outcome == "block":
                    raise Blocked(rule.policy, "found", f.category)
                if outcome == "mask" and f.end > point:
                    point, moved = f.end, True
                if outcome == "mask":
                    masks.append(f)
        if point <= 0:
            return ""
        raw = held[:point]
        chunk = mask(raw, _disjoint(masks, point))
        if self._others:
            chunk = (await run(self._others, [chunk], self._ctx, self._verdicts))[0]
        self._held = held[point:]
        self._before = (self._before + raw)[-CONTEXT:]
        return chunk

    def _scan(self, held: str) -> list[tuple[Rule, Finding]]:
        """Every span guard's findings in the held text (offsets into it; a match that
        began in the released context starts at 0), each noted once as checked."""
        if not self._spans:
            return []
        before = self._before
        text, shift = before + held, len(before)
        out: list[tuple[Rule, Finding]] = []
        for rule in self._spans:
            began = time.perf_counter()
            found = [(rule, Finding(max(f.start - shift, 0), f.end - shift, f.category))
                     for f in rule.guard.find(text) if f.end > shift]
            if not found:
                self._verdicts.note(rule.policy, "post", "allow", time.perf_counter() - began)
            out += found
        return out


def _disjoint(spans: list[Finding], point: int) -> list[Finding]:
    out: list[Finding] = []
    for f in sorted(spans):
        f = Finding(f.start, min(f.end, point), f.category)
        if out and f.start < out[-1].end:
            last = out[-1]
            out[-1] = Finding(last.start, max(last.end, f.end), last.category)
        elif f.end > f.start:
            out.append(f)
    return out
