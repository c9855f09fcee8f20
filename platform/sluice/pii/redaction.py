"""Personal data and secrets out of everything Sluice stores or emits.

`redact(text)` replaces what its recognizers find with typed placeholders: `[SSN]`,
`[IBAN]`, `[CARD]`, `[EMAIL]`, `[PHONE]`, `[IP]`, `[JWT]`, `[API_KEY]`, `Bearer [TOKEN]`,
and `[<LABEL>]` for a tenant's own patterns. It is idempotent: no placeholder matches a
recognizer, no placeholder is a label, and a span that touches a placeholder is refused
(what was glued to it before redaction made the first pass refuse it too). It is linear
in the input: every pattern is anchored on the boundary of its own character class (a
lookbehind), so each run of characters is tried from its start once, and every
repetition is bounded or possessive, so no attempt backtracks beyond a constant.
Candidates are then validated in Python on bounded spans (the checks and the context
labels are in platform/sluice/pii/patterns.py):

- US SSN: AAA-GG-SSSS (or spaces), letters may touch it ("ssn-536-42-7151"), digits may
  not. Valid: area not 000, 666 or 9xx; group not 00; serial not 0000. Invalid ones and
  bare nine-digit runs are redacted only where the text says SSN beside them, and a
  valid bare run also where it is a quoted string on its own ("The model '536427151'
  does not exist"; not `"customer_id": "536427151"`).
- IBAN: country code, the country's exact length, mod-97 check; spaces allowed.
- Payment cards: 12-19 digits, compact or in groups of 3-6 digits separated by spaces,
  dashes or dots (one kind), Luhn, and a known issuer prefix (Visa, Mastercard, Amex,
  Discover, JCB, Diners, UnionPay, Maestro); not inside a hexadecimal identifier (an
  object id, a digest, a trace id, a UUID), where such a run is chance.
- Phone numbers: E.164 (+...) of any country, and national formats of the configured
  regions (SLUICE_PHONE_REGIONS, default US,GB: regions with variable-length numbering
  such as DE make almost any digit run "valid"), validated by `phonenumbers`. A bare
  digit run (no +, no separators) is a phone number only after a phone word ("tel",
  "call me at") or as a quoted string on its own: "max_tokens is 2147483647" is not
  one. There a US-shaped number needs only NANP's shape (area code 2-9..), not an
  assigned area code: "call me at 5551234567" is redacted.
- Emails, also written "jane(at)example.com", "jane [at] example.com" or, with a dot,
  dash, underscore, plus or percent in the name, "jane.doe at example.com".
- IPv4 (octets <= 255) and IPv6 (`ipaddress`), JWTs (eyJ...eyJ...), API keys
  (sk-/pk-/rk- keys incl. Sluice's, AWS access keys, GitHub and Slack tokens) and bearer
  tokens.
"""

from __future__ import annotations

import bisect
import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache

import phonenumbers
from django.conf import settings

from sluice.pii.patterns import (
    IBAN_LENGTHS,
    card_issuer,
    iban_valid,
    in_hex_identifier,
    luhn,
    nanp_shape,
    phone_context,
    quoted_alone,
    ssn_context,
    ssn_valid,
)


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    label: str


# -- recognizers ---------------------------------------------------------------------
# A number's own edges: no digit (or a digit and a separator) beside it, so no pattern
# starts or ends inside a longer number; letters may touch it ("ssn-536-42-7151",
# "x536-42-7151").
_NUM_START = r"(?<!\d)(?<!\d[.-])"
_NUM_END = r"(?!\d)(?![.-]\d)"
_SSN = re.compile(rf"{_NUM_START}(\d{{3}})([- ]?)(\d{{2}})\2(\d{{4}}){_NUM_END}")
_CARD = re.compile(rf"{_NUM_START}\d(?:[ .-]?\d){{11,18}}(?!\d)")
_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Za-z]{2}\d{2}(?: ?[A-Za-z0-9]){11,30}+")
_EMAIL = re.compile(r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]{1,64}+@"
                    r"[A-Za-z0-9-]{1,63}+(?:\.[A-Za-z0-9-]{1,63}+){1,8}+")
# "@" written out: "(at)", "[at]", "{at}" (spaces allowed), or " at " (group 2).
_EMAIL_AT = re.compile(r"(?<![A-Za-z0-9._%+-])([A-Za-z0-9._%+-]{1,64}+)"
                       r"(?:[^\S\n]{0,2}+[(\[{][^\S\n]{0,2}+(?i:at)[^\S\n]{0,2}+[)\]}]"
                       r"[^\S\n]{0,2}+|[^\S\n]{1,3}+((?i:at))[^\S\n]{1,3}+)(?=[A-Za-z0-9])")
_IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?!\d)(?!\.\d)")
_IPV6 = re.compile(r"(?<![0-9A-Fa-f:.])[0-9A-Fa-f:.]{2,45}+")
_PHONE = re.compile(r"(?<![\w+])(?:\+|\(\d|\d)[\d ().-]{5,22}+")
_JWT = re.compile(r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]++\.eyJ[A-Za-z0-9_-]++"
                  r"\.[A-Za-z0-9_-]*+")
_API_KEY = re.compile(
    r"(?<![A-Za-z0-9_-])(?:(?:sk|pk|rk)-[A-Za-z0-9_-]{16,}+"
    r"|AKIA[0-9A-Z]{16}(?![0-9A-Z])"
    r"|gh[pousr]_[A-Za-z0-9]{30,}+"
    r"|xox[abprs]-[A-Za-z0-9-]{10,}+)")
_BEARER = re.compile(r"(?i)(?<![A-Za-z0-9\]])(bearer\s{1,8}+)[A-Za-z0-9._~+/=-]{8,}+")


Free = Callable[[Span], bool]  # does a span overlap none already claimed?


# A placeholder just before or after a span, or across up to two of ".", ":", "-". (A
# tenant's label with a digit is not recognised here: "[AT611904300234573201]" in text
# is an IBAN in brackets, not a placeholder.)
_PLACEHOLDER_BEFORE = re.compile(r"\[[A-Z][A-Z_]{0,31}\][.:-]{0,2}$")
_PLACEHOLDER_AFTER = re.compile(r"[.:-]{0,2}\[[A-Z][A-Z_]{0,31}\]")


def _touches_placeholder(text: str, span: Span) -> bool:
    return (_PLACEHOLDER_BEFORE.search(text, max(0, span.start - 36), span.start) is not None
            or _PLACEHOLDER_AFTER.match(text, span.end) is not None)


def _scan(pattern: re.Pattern[str], text: str, free: Free,
          check: Callable[[re.Match[str]], Span | None], pos: int = 0,
          end: int | None = None) -> Iterable[Span]:
    """Candidates of `pattern`, validated by `check`. A rejected candidate does not hide
    what starts inside it ("1234 4111 1111 1111 1111" holds a card after a number):
    the search resumes one character on, where the lookbehinds let only the starts of
    runs through, so the work stays linear. A span that overlaps text another
    recognizer claimed counts as rejected, and so does one that touches a placeholder
    ("[EMAIL]-536-42-7151"): where a placeholder stands, a token stood that the first
    pass saw glued to this one, so redacting again must not find what it did not."""
    end = len(text) if end is None else end
    while pos < end:
        m = pattern.search(text, pos, end)
        if m is None:
            return
        span = check(m)
        if span is not None and free(span) and not _touches_placeholder(text, span):
            yield span
            pos = max(span.end, m.start() + 1)
        else:
            pos = m.start() + 1


# Where a number can be: a whole run of digits and the characters numbers are written
# with (spaces, dots, dashes, parentheses, "+"), holding a digit. Every SSN, card, IPv4
# and phone candidate is made of these characters only (one without a digit is never
# valid), so it lies inside one run: their patterns search only there (their
# lookbehinds still see the text before, and the character after a run is none of its
# own). Linear: a run is tried from its start only, and nothing in it backtracks.
_NUMBER_RUN = re.compile(r"(?<![\d .()+\-])[ .()+\-]*+\d[\d .()+\-]*+")


@lru_cache(maxsize=8)
def _number_runs(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((m.start(), min(m.end() + 1, len(text))) for m in _NUMBER_RUN.finditer(text))


def _scan_numbers(pattern: re.Pattern[str], text: str, free: Free,
                  check: Callable[[re.Match[str]], Span | None]) -> Iterable[Span]:
    """`_scan` of a number pattern, in the text's number runs only."""
    for start, end in _number_runs(text):
        yield from _scan(pattern, text, free, check, start, end)


def _ssn(text: str, free: Free) -> Iterable[Span]:
    def check(m: re.Match[str]) -> Span | None:
        area, sep, group, serial = m.groups()
        shaped = ssn_valid(area, group, serial) and (
            bool(sep) or quoted_alone(text, m.start(), m.end()))
        if shaped or ssn_context(text, m.start(), m.end()):
            return Span(m.start(), m.end(), "SSN")
        return None
    return _scan_numbers(_SSN, text, free, check)


def _cards(text: str, free: Free) -> Iterable[Span]:
    def check(m: re.Match[str]) -> Span | None:
        raw = m.group()
        if raw[0] not in "23456":
            return None  # no issuer starts otherwise
        # The longest valid card that starts here and ends at a group's end, written
        # compact or in groups of 3-6 digits with one kind of separator (neither
        # "4111-1111 1111 1111" nor "4 1 1 1 ..." is how a card is written).
        groups = list(_DIGIT_GROUPS.finditer(raw))
        for k in range(len(groups), 0, -1):
            sizes = [g.end() - g.start() for g in groups[:k]]
            digits = "".join(g.group() for g in groups[:k])
            if not (12 <= len(digits) <= 19) or (k > 1 and not (
                    min(sizes) >= 3 and max(sizes) <= 6
                    and len({raw[g.end()] for g in groups[:k - 1]}) == 1)):
                continue
            span = Span(m.start(), m.start() + groups[k - 1].end(), "CARD")
            if (card_issuer(digits) and luhn(digits) and free(span)
                    and not in_hex_identifier(text, span.start, span.end)):
                return span
        return None
    return _scan_numbers(_CARD, text, free, check)


def _ibans(text: str, free: Free) -> Iterable[Span]:
    def check(m: re.Match[str]) -> Span | None:
        raw = m.group()
        want = IBAN_LENGTHS.get(raw[:2].upper())
        if want is None:
            return None
        count = 0
        for i, ch in enumerate(raw):
            if ch != " ":
                count += 1
            if count == want:
                after = raw[i + 1:i + 2]
                if iban_valid(raw[:i + 1].replace(" ", "")) and not after.isalnum():
                    return Span(m.start(), m.start() + i + 1, "IBAN")
                return None
        return None
    return _scan(_IBAN, text, free, check)


# A domain ends with its last alphabetic top-level label: labels after it
# ("jane@example.org.416", "...org.eyJhbGciOi...") belong to the next token.
_DOMAIN = re.compile(r"(?:[A-Za-z0-9-]{1,63}\.){1,8}[A-Za-z]{2,63}(?!-?[A-Za-z0-9])")


def _emails(text: str, free: Free) -> Iterable[Span]:
    def check(m: re.Match[str]) -> Span | None:
        local, _, rest = m.group().partition("@")
        domain = _DOMAIN.match(rest)
        if local.strip(".") and domain:
            return Span(m.start(), m.start() + len(local) + 1 + domain.end(), "EMAIL")
        return None

    def spelled(m: re.Match[str]) -> Span | None:
        local, plain = m.group(1), m.group(2) is not None
        domain = _DOMAIN.match(text, m.end())
        # " at " is prose ("look at example.com", "e.g. at example.com", "3.12 at
        # python.org") unless the name holds a letter and what names hold and words do
        # not; and a local part has no dot at either end.
        named = any(ch in "._%+-" for ch in local) and any(ch.isalpha() for ch in local)
        if domain is None or local[0] == "." or local[-1] == "." or (plain and not named):
            return None
        return Span(m.start(), domain.end(), "EMAIL")
    if "@" in text:
        yield from _scan(_EMAIL, text, free, check)
    yield from _scan(_EMAIL_AT, text, free, spelled)


def _ipv4(m: re.Match[str]) -> Span | None:
    if all(int(part) <= 255 for part in m.group().split(".")):
        return Span(m.start(), m.end(), "IP")
    return None


def _ipv6(m: re.Match[str]) -> Span | None:
    raw = m.group()
    raw = raw if raw.endswith("::") else raw.rstrip(".:")
    if raw.count(":") < 2:
        return None
    try:
        ipaddress.IPv6Address(raw)
    except ValueError:
        return None
    return Span(m.start(), m.start() + len(raw), "IP")


def _ips(text: str, free: Free) -> Iterable[Span]:
    if text.count(":") >= 2:  # an IPv6 address has two at least
        yield from _scan(_IPV6, text, free, _ipv6)  # first: "::ffff:192.0.2.1" is one
    yield from _scan_numbers(_IPV4, text, free, _ipv4)


@lru_cache(maxsize=1)
def _regions() -> tuple[str, ...]:
    raw = getattr(settings, "SLUICE_PHONE_REGIONS", ["US", "GB"])
    return tuple(r.upper() for r in raw)


_US_SHAPES = ([3, 3, 4], [10], [1, 3, 3, 4], [11])


def _phone_regions(raw: str, sizes: list[int]) -> tuple[str | None, ...]:
    """The regions to validate a candidate in, from its shape: E.164 anywhere; national
    US numbers as 3-3-4 (or ten digits, or with a leading 1); other regions' national
    numbers start with their trunk prefix 0. Anything else is not a phone number."""
    digits = sum(sizes)
    if raw.startswith("+"):
        return (None,) if 7 <= digits <= 15 else ()
    out: list[str | None] = []
    for region in _regions():
        if region == "US":
            if sizes in _US_SHAPES and (sizes[0] != 11 or raw.startswith("1")):
                out.append(region)
        elif raw.lstrip("(").startswith("0") and 9 <= digits <= 12 and min(sizes) >= 2:
            out.append(region)
    return tuple(out)


def _said(text: str, span: Span) -> bool:
    """Does the text say the number at `span` is one to reach someone on?"""
    return (phone_context(text, span.start, span.end)
            or quoted_alone(text, span.start, span.end))


def _phones(text: str, free: Free) -> Iterable[Span]:
    def check(m: re.Match[str]) -> Span | None:
        raw = m.group()
        groups = list(_DIGIT_GROUPS.finditer(raw))
        sizes = [g.end() - g.start() for g in groups]
        national = raw.lstrip("(")
        if not (raw[0] == "+" or national[0] == "0" or sizes[0] in (3, 10, 11)
                or sizes[:2] == [1, 3]):
            return None  # no phone shape starts like this
        # The longest prefix that ends with a digit group and is a valid number (the
        # pattern runs on past a number into whatever digits follow it).
        for k in range(len(groups), 0, -1):
            head = raw[:groups[k - 1].end()]
            if head.count("(") != head.count(")") and not head.startswith("("):
                continue
            span = Span(m.start(), m.start() + len(head), "PHONE")
            if k == 1 and head.isdigit() and not _said(text, span):
                continue  # a bare digit run is a phone number only where one is said
            for region in _phone_regions(head, sizes[:k]):
                try:
                    number = phonenumbers.parse(head, region)
                except phonenumbers.NumberParseException:
                    continue
                valid = phonenumbers.is_valid_number(number) or (
                    region == "US" and nanp_shape("".join(g.group() for g in groups[:k]))
                    and _said(text, span))
                if valid and free(span):
                    return span
        return None
    return _scan_numbers(_PHONE, text, free, check)


_DIGIT_GROUPS = re.compile(r"\d+")


Recognizer = Callable[[str, Free], Iterable[Span]]


def _simple(pattern: re.Pattern[str], label: str) -> Recognizer:
    def find(text: str, free: Free) -> Iterable[Span]:
        return _scan(pattern, text, free, lambda m: Span(m.start(), m.end(), label))
    return find


def _bearer(text: str, free: Free) -> Iterable[Span]:
    def check(m: re.Match[str]) -> Span | None:
        token = m.group()[len(m.group(1)):]
        # a credential, not prose ("bearer information"): it has a digit or punctuation
        if any(ch.isdigit() or ch in "._~+/=-" for ch in token) or len(token) >= 24:
            return Span(m.start() + len(m.group(1)), m.end(), "TOKEN")  # "Bearer " stays
        return None
    return _scan(_BEARER, text, free, check)


# In priority order: where spans overlap, the earlier recognizer here keeps its span.
RECOGNIZERS: list[tuple[str, Recognizer]] = [
    ("JWT", _simple(_JWT, "JWT")),
    ("API_KEY", _simple(_API_KEY, "API_KEY")),
    ("TOKEN", _bearer),
    ("EMAIL", _emails),
    ("IBAN", _ibans),
    ("CARD", _cards),
    ("SSN", _ssn),
    ("IP", _ips),
    ("PHONE", _phones),
]


# What a recognizer's match cannot do without, checked at C speed before its scan.
_KEY_PREFIXES = ("sk-", "pk-", "rk-", "AKIA", "ghp_", "gho_", "ghu_", "ghs_", "ghr_",
                 "xoxa-", "xoxb-", "xoxp-", "xoxr-", "xoxs-")
_NEEDS: dict[str, Callable[[str], bool]] = {
    "JWT": lambda text: "eyJ" in text,
    "API_KEY": lambda text: any(prefix in text for prefix in _KEY_PREFIXES),
    "TOKEN": lambda text: "bearer" in text.lower(),
}


# Every built-in recognizer needs one of these to match at all: digits (SSN, cards,
# phones, IBANs, IPv4), "@" or a spelled-out one before a domain (emails), ":" (IPv6), or
# a secret's fixed prefix. Text with none of them (most prose) skips the recognizers in
# one C-speed scan.
_TRIGGER = re.compile(r"[0-9@:]|eyJ|[spr]k-|AKIA|gh[pousr]_|xox[abprs]-|(?i:bearer)"
                      r"|(?i:[(\[{][^\S\n]{0,2}at[^\S\n]{0,2}[)\]}]"
                      r"|[^\S\n]at[^\S\n]{1,3}[a-z0-9-]{1,63}\.[a-z])")


def find(text: str, extra: Iterable[tuple[str, re.Pattern[str]]] = ()) -> list[Span]:
    """Non-overlapping spans to redact, in order. Recognizers claim text in priority
    order (the validated structures first, phones last, a tenant's patterns after)."""
    starts: list[int] = []  # of the chosen spans, sorted
    chosen: dict[int, Span] = {}

    def free(span: Span) -> bool:
        i = bisect.bisect_right(starts, span.start)
        if i and chosen[starts[i - 1]].end > span.start:
            return False  # overlaps the span before it
        return not (i < len(starts) and starts[i] < span.end)  # ... or the one after

    def claim(spans: Iterable[Span]) -> None:
        for span in spans:  # lazily: each claim is seen by the recognizer's next check
            bisect.insort(starts, span.start)
            chosen[span.start] = span

    if _TRIGGER.search(text):
        for label, recognizer in RECOGNIZERS:
            needs = _NEEDS.get(label)
            if needs is None or needs(text):
                claim(recognizer(text, free))
    for label, pattern in extra:
        claim(_simple(pattern, label)(text, free))
    return [chosen[s] for s in starts]


def redact(text: str, extra: Iterable[tuple[str, re.Pattern[str]]] = ()) -> str:
    """`text` with every recognised identifier replaced by its placeholder."""
    if not text:
        return text
    out, last = [], 0
    for span in find(text, extra):
        out.append(text[last:span.start])
        out.append(f"[{span.label}]")
        last = span.end
    out.append(text[last:])
    return "".join(out)
