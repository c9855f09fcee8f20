"""The guard contract, and the guards that find spans: `pii` and `words`.

A guard reads a call's texts (the request's messages, tool definitions and tool-call
arguments; or the reply) and answers a `Verdict`: whether it found anything, in which
category, and either the spans it found in each text (a span guard: the runner masks
them as `[CATEGORY]`) or the texts rewritten (a guard that masks by itself: the
webhook). A guard never decides what happens: its policy's action does (runner.py).

Span guards are synchronous and linear in their input, so streams can run them on
every held-back window (holdback.py); the others are awaited, each under its policy's
timeout.

- `pii`: the redaction engine's recognizers (platform/sluice/pii/redaction.py: SSN,
  IBAN, CARD, EMAIL, PHONE, IP, JWT, API_KEY, TOKEN, with their checksums) and the
  tenant's own redaction patterns (their labels are categories too). `categories`
  narrows them (none: all).
- `words`: config `deny` (words or phrases, matched whole-word, case-insensitive unless
  `case_sensitive`), `deny_regex` (regexes, refused on save unless they run in linear
  time: sluice.pii.safe_patterns.compile_tenant_pattern), `allow` and `allow_regex`
  (exceptions: a denied match inside an allowed one is not a finding). Category
  `DENIED`, or the policy's first category.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from governance.guardrails.policy import Policy
from sluice.pii.redaction import find
from sluice.pii.safe_patterns import UnsafePattern, compile_tenant_pattern

Patterns = tuple[tuple[str, re.Pattern[str]], ...]

MAX_TERMS = 1000
MAX_TERM_CHARS = 200


class Finding(NamedTuple):
    start: int
    end: int
    category: str


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a guard found in a call's texts (`found`; `category` the first found).
    A span guard's `spans` lists each text's findings; a guard that rewrites gives
    `texts` (each text as it would mask it) instead. `reason`: the guard's own words,
    for the audit (never shown to the caller)."""

    found: bool
    category: str = ""
    spans: tuple[tuple[Finding, ...], ...] | None = None
    texts: tuple[str, ...] | None = None
    reason: str = ""


CLEAN = Verdict(False)


# A classifier deployment's probabilities for texts, and its labels (the pipeline's,
# made for each call: streaming/pipeline/guarding.py).
Classify = Callable[[str, list[str]], Awaitable[tuple[list[list[float]], list[str]]]]
# A judge model's answer for a text under instructions: (allowed, category); its
# arguments: model, instructions, text, max tokens.
Judge = Callable[[str, str, str, int], Awaitable[tuple[bool, str]]]


class Context(NamedTuple):
    """Who the texts are from, for guards that pass it on (the webhook), and how a
    classifier or judge guard reaches its model (`classify`, `judge`)."""

    tenant: str
    key_prefix: str
    model: str
    phase: str
    request_id: str = ""
    classify: Classify | None = None
    judge: Judge | None = None


class Guard:
    """A guard; `spans` is True for a span guard (`find`)."""

    spans = False

    async def check(self, texts: Sequence[str], ctx: Context) -> Verdict:
        raise NotImplementedError

    def find(self, text: str) -> list[Finding]:
        raise NotImplementedError


class Broken(Guard):
    """A policy whose guard cannot be built (a stored row that no longer validates):
    every check fails, and the policy's failure mode decides."""

    def __init__(self, why: str) -> None:
        self.why = why

    async def check(self, texts: Sequence[str], ctx: Context) -> Verdict:
        raise RuntimeError(self.why)


class SpanGuard(Guard):
    spans = True

    async def check(self, texts: Sequence[str], ctx: Context) -> Verdict:
        return self.verdict(texts)

    def verdict(self, texts: Sequence[str]) -> Verdict:
        spans = tuple(tuple(self.find(text)) for text in texts)
        first = next((s[0] for s in spans if s), None)
        if first is None:
            return CLEAN
        return Verdict(True, first.category, spans=spans)


class PiiGuard(SpanGuard):
    def __init__(self, categories: Sequence[str], patterns: Patterns) -> None:
        self._only = frozenset(c.upper() for c in categories)
        self._patterns = patterns

    def find(self, text: str) -> list[Finding]:
        only = self._only
        return [Finding(s.start, s.end, s.label) for s in find(text, self._patterns)
                if not only or s.label in only]


class WordsGuard(SpanGuard):
    def __init__(self, config: dict[str, Any], category: str) -> None:
        flags = 0 if config.get("case_sensitive") else re.IGNORECASE
        self._deny = _terms(config.get("deny"), config.get("deny_regex"), flags)
        self._allow = _terms(config.get("allow"), config.get("allow_regex"), flags)
        self._category = category

    def find(self, text: str) -> list[Finding]:
        found: list[Finding] = []
        allowed = [m.span() for p in self._allow for m in p.finditer(text)]
        for pattern in self._deny:
            for m in pattern.finditer(text):
                start, end = m.span()
                if not any(a <= start and end <= b for a, b in allowed):
                    found.append(Finding(start, end, self._category))
        found.sort()
        return _disjoint(found)


def _terms(words: Any, regexes: Any, flags: int) -> list[re.Pattern[str]]:
    """One pattern for the literal terms (whole words), one per regex."""
    out: list[re.Pattern[str]] = []
    if words:
        out.append(re.compile(rf"(?<!\w){_trie(words, fold=bool(flags))}(?!\w)", flags))
    for source in regexes or ():
        out.append(re.compile(compile_tenant_pattern(source).pattern, flags))
    return out


def _trie(words: Any, *, fold: bool) -> str:
    """The terms as one regex shaped like their prefix tree: at a word's start the
    search follows the tree (work bounded by the longest term), where an alternation of
    every term would try each in turn; a longer term is tried before a shorter one
    that it continues, as longest-first alternation does. `fold`: the pattern ignores
    case, so terms that differ only in case share their branches."""
    tree: dict[str, Any] = {}
    for word in words:
        node = tree
        for ch in word:
            key = ch.lower() if fold and len(ch.lower()) == 1 else ch
            node = node.setdefault(key, {})
        node[""] = {}  # a term ends here

    def pattern(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in node.items() if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        return f"(?:{body})?" if "" in node else body

    return f"(?:{pattern(tree)})"


def _disjoint(found: list[Finding]) -> list[Finding]:
    """Sorted findings with overlaps merged (the earlier one's category)."""
    out: list[Finding] = []
    for f in found:
        if out and f.start < out[-1].end:
            last = out[-1]
            out[-1] = Finding(last.start, max(last.end, f.end), last.category)
        else:
            out.append(f)
    return out


def check_words_config(config: dict[str, Any]) -> dict[str, Any]:
    """A `words` policy's config as stored, or ValueError naming what is wrong: lists of
    at most MAX_TERMS strings of 1 to MAX_TERM_CHARS characters, regexes that run in
    linear time, at least one deny term."""
    known = {"deny", "deny_regex", "allow", "allow_regex", "case_sensitive"}
    unknown = set(config) - known
    if unknown:
        raise ValueError(f"unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(known))})")
    out: dict[str, Any] = {"case_sensitive": bool(config.get("case_sensitive", False))}
    for key in ("deny", "deny_regex", "allow", "allow_regex"):
        terms = config.get(key) or []
        if not isinstance(terms, list) or len(terms) > MAX_TERMS or not all(
                isinstance(t, str) and 0 < len(t) <= MAX_TERM_CHARS and t.strip()
                for t in terms):
            raise ValueError(f"{key}: a list of at most {MAX_TERMS} non-blank strings of "
                             f"at most {MAX_TERM_CHARS} characters")
        if key.endswith("_regex"):
            for source in terms:
                try:
                    compile_tenant_pattern(source)
                except UnsafePattern as exc:
                    raise ValueError(f"{key}: {source!r}: {exc}") from None
        out[key] = terms
    if not out["deny"] and not out["deny_regex"]:
        raise ValueError("deny or deny_regex: at least one term to look for")
    return out


def guard_of(policy: Policy, patterns: Patterns) -> Guard:
    """The guard a policy runs (for the tenant whose redaction `patterns` these are);
    built once per cached policy set (governance/cache.py)."""
    if policy.guard == "pii":
        return PiiGuard(policy.categories, patterns)
    if policy.guard == "words":
        return WordsGuard(policy.config, (policy.categories or ("DENIED",))[0].upper())
    if policy.guard == "webhook":
        from governance.guardrails.webhook import WebhookGuard
        return WebhookGuard(policy)
    if policy.guard == "classifier":
        from governance.guardrails.classifier import ClassifierGuard
        return ClassifierGuard(policy)
    if policy.guard == "judge":
        from governance.guardrails.judge import JudgeGuard
        return JudgeGuard(policy)
    raise ValueError(f"guard {policy.guard!r} is not built")
