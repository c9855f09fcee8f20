"""A labelled corpus for the redaction engine: generated valid identifiers of every kind
(seeded, so the corpus is the same on every run), hand-picked real-world shapes (the
forms issue #28 found missed among them), and numbers that are not personal data and
must stay untouched, by category (large integers, token counts, ids, timestamps,
versions, dates, prices, hashes, UUIDs, order numbers, near misses of each recognizer).

`score(find)` measures a recognizer set on it: per recognizer, per positive form and per
negative category. Used by test_redaction.py (which holds the floors) and by
tests/bench/redaction_scores.py (which prints the tables in docs/AUDIT.md)."""

from __future__ import annotations

import base64
import json
import random
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sluice.pii.patterns import IBAN_LENGTHS, luhn
from sluice.pii.redaction import Span


@dataclass(frozen=True)
class Sample:
    text: str
    secret: str  # the substring that must vanish ("" for a negative)
    label: str  # the recognizer that must catch it ("" for a negative)
    form: str = ""  # a shape reported on its own (the forms issue #28 found missed)


_RNG = random.Random(20261203)
_TEMPLATES = ["my {k} is {v}, thanks", "{v}", "({v})", "{k}: {v}.", "send it to {v} today",
              "\"{v}\"", "line one\n{k}={v}\nline three"]


def _wrap(kind: str, value: str, label: str) -> Sample:
    template = _RNG.choice(_TEMPLATES)
    return Sample(template.format(k=kind, v=value), value, label)


def _digits(n: int) -> str:
    return "".join(_RNG.choice("0123456789") for _ in range(n))


def _card(prefix: str, length: int) -> str:
    body = prefix + _digits(length - len(prefix) - 1)
    for check in "0123456789":
        if luhn(body + check):
            return body + check
    raise AssertionError


def _grouped(number: str, groups: list[int], sep: str) -> str:
    out, i = [], 0
    for g in groups:
        out.append(number[i:i + g])
        i += g
    return sep.join(out)


def _iban(country: str) -> str:
    bban = _digits(IBAN_LENGTHS[country] - 4)
    moved = bban + country + "00"
    check = 98 - int("".join(str(int(ch, 36)) for ch in moved)) % 97
    return f"{country}{check:02d}{bban}"


def _b64(obj: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")


def _alnum(n: int) -> str:
    return "".join(_RNG.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
                   for _ in range(n))


def positives() -> list[Sample]:
    _RNG.seed(20261203)  # the same samples on every call
    out: list[Sample] = []
    # SSN: valid areas, groups and serials, with - or space
    for _ in range(60):
        area = _RNG.choice([a for a in range(1, 900) if a != 666])
        value = f"{area:03d}{_RNG.choice('- ')}{_RNG.randint(1, 99):02d}"
        value = f"{value}{value[3]}{_RNG.randint(1, 9999):04d}"
        out.append(_wrap("ssn", value, "SSN"))
    for text, value in [("SSN: 000-12-3456", "000-12-3456"),
                        ("social security number 666-12-3456", "666-12-3456"),
                        ("SSN 123456789 on file", "123456789"),
                        ("ss# 912-34-5678", "912-34-5678")]:
        out.append(Sample(text, value, "SSN"))
    # IBANs of many countries, compact and in groups of four
    for country in sorted(IBAN_LENGTHS):
        value = _iban(country)
        if _RNG.random() < 0.5:
            value = " ".join(value[i:i + 4] for i in range(0, len(value), 4))
        out.append(_wrap("iban", value, "IBAN"))
    for value in ["GB82 WEST 1234 5698 7654 32", "DE89370400440532013000",
                  "FR14 2004 1010 0505 0001 3M02 606", "NL91ABNA0417164300"]:
        out.append(_wrap("iban", value, "IBAN"))
    # cards: every issuer, compact / spaced / dashed
    brands = [("4", 16, [4, 4, 4, 4]), ("4", 13, [4, 4, 5]), ("51", 16, [4, 4, 4, 4]),
              ("2221", 16, [4, 4, 4, 4]), ("34", 15, [4, 6, 5]), ("37", 15, [4, 6, 5]),
              ("6011", 16, [4, 4, 4, 4]), ("65", 16, [4, 4, 4, 4]),
              ("3530", 16, [4, 4, 4, 4]), ("36", 14, [4, 6, 4]), ("62", 16, [4, 4, 4, 4]),
              ("6759", 16, [4, 4, 4, 4]), ("4", 19, [4, 4, 4, 4, 3])]
    for prefix, length, groups in brands:
        for sep in ("", " ", "-"):
            number = _card(prefix, length)
            out.append(_wrap("card", _grouped(number, groups, sep) if sep else number,
                             "CARD"))
    # emails
    for _ in range(30):
        local = _RNG.choice(["jane.doe", "j_smith+tag", "x", "first.last-99", "ops%team"])
        domain = _RNG.choice(["example.com", "mail.example.co.uk", "corp-mail.io",
                              "sub.domain.example.org"])
        out.append(_wrap("email", f"{local}{_RNG.randint(1, 999)}@{domain}", "EMAIL"))
    # phones: E.164 and national formats
    for value in ["+14155552671", "+1 415 555 2671", "+44 20 7946 0958", "+49 30 901820",
                  "+33 1 42 68 53 00", "+91 98765 43210", "(415) 555-2671", "415-555-2671",
                  "415.555.2671", "020 7946 0958", "07911 123456", "1-415-555-2671"]:
        out.append(_wrap("phone", value, "PHONE"))
    for _ in range(30):
        area = _RNG.choice([201, 212, 312, 415, 617, 650, 718, 202, 305, 512])
        value = f"{area}-{_RNG.randint(200, 999)}-{_RNG.randint(0, 9999):04d}"
        out.append(_wrap("phone", value, "PHONE"))
    # IP addresses
    for _ in range(20):
        out.append(_wrap("ip", ".".join(str(_RNG.randint(0, 255)) for _ in range(4)), "IP"))
    for value in ["2001:db8::1", "fe80::1ff:fe23:4567:890a", "::1",
                  "2001:0db8:85a3:0000:0000:8a2e:0370:7334", "::ffff:192.0.2.128"]:
        out.append(_wrap("ip", value, "IP"))
    # secrets
    for _ in range(10):
        header = _b64({"alg": "HS256", "typ": "JWT"})
        payload = _b64({"sub": _alnum(8), "iat": _RNG.randint(10**9, 2 * 10**9)})
        out.append(_wrap("token", f"{header}.{payload}.{_alnum(43)}", "JWT"))
    for value in [f"sk-sluice-{_alnum(10).lower()}-{_alnum(43)}", f"sk-proj-{_alnum(40)}",
                  f"sk-{_alnum(48)}", "AKIA" + "".join(_RNG.choice("ABCDEFGHIJKLMNOP234567")
                                                       for _ in range(16)),
                  f"ghp_{_alnum(36)}", f"xoxb-{_digits(12)}-{_alnum(24)}"]:
        out.append(_wrap("api_key", value, "API_KEY"))
    for token in [_alnum(32), f"{_alnum(20)}.{_alnum(10)}", "abc123def456ghi7"]:
        out.append(Sample(f"Authorization: Bearer {token}", token, "TOKEN"))
    out += _missed_forms()
    return out


def _ssn_value(sep: str) -> str:
    area = _RNG.choice([a for a in range(1, 900) if a != 666])
    return f"{area:03d}{sep}{_RNG.randint(1, 99):02d}{sep}{_RNG.randint(1, 9999):04d}"


def _us_phone() -> str:
    area = _RNG.choice([201, 212, 312, 415, 617, 650, 718, 202, 305, 512])
    return f"{area}{_RNG.randint(200, 999)}{_RNG.randint(0, 9999):04d}"


# Where an SSN touches a word, and how text says a bare number is one.
_SSN_GLUED = ["ssn-{v}", "x{v}", "{v}x", "SSN#{v}", "ssn_{v}", "id:{v}", "ref{v}.",
              "({v})th", "SSN{v}", "[{v}]"]
_SSN_LABELS = ["SSN {v}", "social security number: {v}", "SSN number {v}", "SSN no: {v}",
               "Social Security #: {v}", "SSN is: {v}", "SSN ({v})", "ssn={v}", "SSN:{v}",
               "ssn-{v}", "her SSN, {v}", "SSN was {v}", "my social security number is {v}",
               '"ssn": "{v}"', '{{"ssn":{v}}}', "<ssn>{v}</ssn>", "SSNs: {v}",
               "S.S.N. {v}", "SocialSecurityNumber={v}", "social_security_number: {v}",
               "SSN on file: {v}", "{v} is my SSN", "{v} (SSN)", "soc. sec. no. {v}",
               "SSN\n{v}", "ssn_{v}", "my ss number {v}"]
_PHONE_LABELS = ["phone: {v}", "call me at {v}", "tel {v}", "Mobile: {v}", "fax no. {v}",
                 "cell {v}", "WhatsApp {v}", "phone number is {v}", "Tel.:{v}", "call {v}",
                 "{v} (mobile)", "reach me on {v}", "{v} is my cell"]


def _missed_forms() -> list[Sample]:
    """The forms issue #28 found missed, each reported as its own row by `score`."""
    out = [Sample(t, v, "SSN", "ssn glued to a word") for t, v in [
        ("ssn-536-42-7151", "536-42-7151"), ("x536-42-7151", "536-42-7151"),
        ("536-42-7151x", "536-42-7151")]]
    out += [Sample("SSN 536427151", "536427151", "SSN", "ssn bare, labelled"),
            Sample("social security number: 536427151", "536427151", "SSN",
                   "ssn bare, labelled")]
    for template in _SSN_GLUED:
        value = _ssn_value(_RNG.choice("- "))
        out.append(Sample(template.format(v=value), value, "SSN", "ssn glued to a word"))
    for template in _SSN_LABELS:
        for _ in range(2):
            value = _ssn_value("")
            out.append(Sample(template.format(v=value), value, "SSN", "ssn bare, labelled"))
    brands = [("4", 16, [4, 4, 4, 4]), ("51", 16, [4, 4, 4, 4]), ("34", 15, [4, 6, 5]),
              ("6011", 16, [4, 4, 4, 4]), ("3530", 16, [4, 4, 4, 4]), ("36", 14, [4, 6, 4]),
              ("62", 16, [4, 4, 4, 4]), ("4", 19, [4, 4, 4, 4, 3])]
    out.append(Sample("pay with 4111.1111.1111.1111 today", "4111.1111.1111.1111", "CARD",
                      "card with dots"))
    for prefix, length, groups in brands:
        value = _grouped(_card(prefix, length), groups, ".")
        out.append(Sample(_RNG.choice(_TEMPLATES).format(k="card", v=value), value, "CARD",
                          "card with dots"))
    for template in _PHONE_LABELS:
        for value in [_us_phone(), "1" + _us_phone()]:
            out.append(Sample(template.format(v=value), value, "PHONE",
                              "phone bare, beside a phone word"))
    for value in ["07911123456", "02079460958"]:
        out.append(Sample(f"mobile {value}", value, "PHONE", "phone bare, beside a phone word"))
    return out + _standalone_forms()


# How a bare number is said to be typed on its own: the whole of a quoted string.
_QUOTED = ["The model '{v}' does not exist or you do not have access to it.",
           "The model '{v}' does not exist.", 'unknown value "{v}"', "got `{v}`",
           "\u201c{v}\u201d he wrote", "['{v}']", "search for '{v}', no results"]
_SPELLED_AT = ["{l}(at){d}", "{l} [at] {d}", "{l} (AT) {d}", "{l}{{at}}{d}", "{l}[at]{d}",
               "{l} at {d}", "{l} AT {d}"]


def _nanp() -> str:
    return (f"{_RNG.randint(2, 9)}{_RNG.randint(0, 99):02d}{_RNG.randint(2, 9)}"
            f"{_RNG.randint(0, 99):02d}{_RNG.randint(0, 9999):04d}")


def _standalone_forms() -> list[Sample]:
    """Issue #41's forms: a bare SSN or NANP number quoted on its own, a phone word
    before an unassigned area code (555), and e-mail with "@" spelled out."""
    out = [Sample("The model '123456789' does not exist or you do not have access to it.",
                  "123456789", "SSN", "ssn bare, quoted alone"),
           Sample("The model '5551234567' does not exist.", "5551234567", "PHONE",
                  "phone bare, quoted alone")]
    for template in _QUOTED:
        for _ in range(2):
            value = _ssn_value("")
            out.append(Sample(template.format(v=value), value, "SSN", "ssn bare, quoted alone"))
            value = _RNG.choice(["", "1"]) + _nanp()
            out.append(Sample(template.format(v=value), value, "PHONE",
                              "phone bare, quoted alone"))
    for template in ["call me at {v}", "phone: {v}", "{v} (mobile)", "tel {v}"]:
        for value in ["5551234567", "555-123-4567", "(555) 123-4567", "1" + _nanp()]:
            out.append(Sample(template.format(v=value), value, "PHONE",
                              "phone bare, beside a phone word"))
    for template in _SPELLED_AT:
        for _ in range(2):
            local = _RNG.choice(["jane.doe", "j_smith+tag", "first.last-99", "ops%team"])
            if " at " not in template.lower():  # a bracketed "at" needs no such name
                local = _RNG.choice([local, "jane", "x", "jdoe42"])
            domain = _RNG.choice(["example.com", "mail.example.co.uk", "corp-mail.io",
                                  "sub.domain.example.org"])
            value = template.format(l=local, d=domain)
            out.append(Sample(f"write to {value} please", value, "EMAIL",
                              "email with a spelled-out at"))
    return out


# Hand-picked numbers and near misses, by category: each must stay exactly as it is.
HAND_PICKED: dict[str, list[str]] = {
    "ssn near misses": [
        "'000123456'", "'666123456'", "'912345678'", "'123004567'", "'536420000'",
        "'53642715'", "'536427151x'", "'536427151\"", '"customer_id": "536427151"',
        "customer_id='536427151'", "{'536427151': 3}", "ref '1536427151 '",
        "000-12-3456", "666-45-6789", "900-12-3456", "123-00-4567", "123-45-0000",
        "1234-56-789", "12-345-6789", "order 123456789 shipped", "2026-12-03",
        "SSN verified, order 123456789 shipped", "assn 123456789", "1-536-42-7151",
        "536-42-7151-0001", "4111-536-42-7151", "class no 123456789"],
    "iban near misses": [
        "DE89 3704 0044 0532 0130 01", "DE8937040044053201300", "XX12 3456 7890 1234 56",
        "GB82 WEST 1234 5698 7654 33", "ID12345678901234 is a serial"],
    "card near misses": [
        "4111 1111 1111 1112", "1234 5678 9012 3452", "4111 1111 111", "4111-1111 1111 1111",
        "0000 0000 0000 0000", "tracking 9400111202555842761534", "4111.1111.1111.1112",
        "4 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1", "4111.1111-1111 1111", "1.4111.1111.1111.1111"],
    "email near misses": [
        "user@localhost", "user@@example.com", "@example.com", "name at example dot com",
        "user@example.", "see @mentions", "a@b.c", "look at example.com",
        "e.g. at example.com", "see i.e. at github.com/x", "jane at example",
        "user (at) localhost", "Python 3.12 at python.org", "stay at home.today",
        "jane.doe at example. com", "meet.me at noon", "spec (at) v2"],
    "phone near misses": [
        "12345", "1 2 3 4 5 6 7", "call 555-2671", "123-456-7890", "version 1.2.3",
        "ISBN 978", "12:30 pm", "room 101", "'1234567890'", "'1120550199'", "'0123456789'",
        "'41555526712'", '"seed": "4155552671"', "ts='1733212800'", "'4155552671': 2",
        "order 5551234567 shipped", "555-123-4567", "phone: 123-456-7890"],
    "ip near misses": ["256.1.1.1", "1.2.3", "1.2.3.4.5", "a:b", "2001:db8:::1", "cafe",
                       "deadbeef"],
    "secret near misses": [
        "eyJhbGciOi", "eyJ.abc.def", "sk-short", "AKIA123", "task-force-one",
        "risk-management", "bearer bonds", "Bearer of bad news", "the bearer information",
        "skeleton-key"],
    "placeholders": [
        "[SSN] [IBAN] [CARD] [EMAIL] [PHONE] [IP] [JWT] [API_KEY] Bearer [TOKEN]"],
    "large integers": [
        "max_tokens is 2147483647; this model's context is 2048 tokens.",
        "max_tokens is 4294967295", "offset 9223372036854775807 is too large",
        "18446744073709551615", "seed=4155552671", "n = 2125550199", "1000000007",
        "id 2147483647 - call failed"],
    "token counts": [
        "usage: 4155 prompt + 2671 completion tokens", "context window of 2097152 tokens",
        '{"prompt_tokens": 131072, "completion_tokens": 4096, "total_tokens": 135168}'],
    "ids": [
        "user id 4155552671", "customer_id=536427151", "request 6175550123 failed",
        "account 0123456789", "message 1187429581962403840", "pid 48213"],
    "timestamps": [
        "created 1733212800", "ts=1733212800123", "2026-12-03T10:15:30Z",
        "2026-12-03 10:15:30.123456+00:00", "Tue, 03 Dec 2026 10:15:30 GMT",
        "1733212800123456789 ns"],
    "version strings": ["v2.14.3", "numpy==1.26.4", "Chrome/120.0.6099.109",
                        "Windows 10.0.19045.3803", "CUDA 12.4.131", "build 2026.12.03.4155"],
    "iso dates": ["2026-12-03", "2026-W49-4", "2026-337", "20261203", "03/12/2026",
                  "2026-12-03/2026-12-31"],
    "prices": ["$1,299.99", "€4.111,11", "USD 2147483647.00", "1 234 567,89 €",
               "JPY 4155552671", "price: 19.99"],
    "hex hashes": ["d41d8cd98f00b204e9800998ecf8427e",
                   "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
                   "commit 8d47537"],
    "uuids": ["123e4567-e89b-12d3-a456-426614174000", "550e8400-e29b-41d4-a716-446655440000"],
    "order numbers": ["order #4155552671", "PO 4500012345", "ORD-2026-000123",
                      "INV-000123456", "tracking 1Z999AA10123456784",
                      "Amazon order 112-4155552-6710001"],
}
NEGATIVES: list[str] = [text for texts in HAND_PICKED.values() for text in texts]


def _generated_negatives(rng: random.Random) -> dict[str, list[str]]:
    """Numbers that are not personal data, drawn at random in their usual contexts."""
    def digits(n: int, first: str = "123456789") -> str:
        return rng.choice(first) + "".join(rng.choice("0123456789") for _ in range(n - 1))

    def hexes(n: int) -> str:
        return f"{rng.getrandbits(4 * n):0{n}x}"

    contexts = ["max_tokens is {n}", "value {n} is out of range", "count={n}", "{n} bytes",
                "limit: {n}", "seed {n}", '{{"n": {n}}}']
    out: dict[str, list[str]] = {
        "large integers": [rng.choice(contexts).format(n=digits(n))
                           for n in range(7, 21) for _ in range(10)],
        "token counts": [f"prompt_tokens: {rng.randint(1, 2_000_000)}, completion_tokens: "
                         f"{rng.randint(1, 100_000)}" for _ in range(40)],
        "ids": ([f"user id {digits(10)}" for _ in range(30)]
                + [f"customer_id={digits(9)}" for _ in range(30)]
                + [f"snowflake {digits(rng.choice([18, 19]), '1')}" for _ in range(20)]
                + [f"trace_id={hexes(32)} span_id={hexes(16)}" for _ in range(20)]),
        "timestamps": ([f"ts={rng.randint(10**9, 2 * 10**9)}" for _ in range(30)]
                       + [f"at {rng.randint(10**12, 2 * 10**12)} ms" for _ in range(20)]
                       + [f"{rng.randint(2000, 2030)}-{rng.randint(1, 12):02d}-"
                          f"{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:"
                          f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}."
                          f"{rng.randint(0, 999999):06d}Z" for _ in range(30)]),
        "version strings": [f"v{rng.randint(0, 30)}.{rng.randint(0, 99)}.{rng.randint(0, 999)}"
                            f".{rng.randint(0, 9999)}" for _ in range(40)],
        "iso dates": [f"{rng.randint(1900, 2099)}-{rng.randint(1, 12):02d}-"
                      f"{rng.randint(1, 28):02d}" for _ in range(40)],
        "prices": [f"${rng.randint(1, 999)},{rng.randint(0, 999):03d},{rng.randint(0, 999):03d}"
                   f".{rng.randint(0, 99):02d}" for _ in range(40)],
        "hex hashes": [hexes(rng.choice([7, 32, 40, 64])) for _ in range(60)],
        "uuids": [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(60)],
        "order numbers": ([f"order #{digits(10)}" for _ in range(30)]
                          + [f"PO 45{digits(8, '0123456789')}" for _ in range(20)]
                          + [f"INV-{digits(9)}" for _ in range(20)]),
    }
    # Quoted, but as a key's value: the key says what the number is.
    out["ids"] += ([f'{{"user_id": "{digits(10)}"}}' for _ in range(20)]
                   + [f"{{'customer_id': '{digits(9)}'}}" for _ in range(20)]
                   + [f"request_id='{digits(rng.choice([9, 10]))}'" for _ in range(20)])
    return out


def negatives() -> dict[str, list[str]]:
    """Every negative by category: the hand-picked ones, then the generated ones."""
    out = {category: list(texts) for category, texts in HAND_PICKED.items()}
    for category, texts in _generated_negatives(random.Random(28)).items():
        out[category] += texts
    return out


@dataclass
class Scores:
    tp: Counter[str] = field(default_factory=Counter)
    fn: Counter[str] = field(default_factory=Counter)
    fp: Counter[str] = field(default_factory=Counter)
    forms: Counter[str] = field(default_factory=Counter)  # samples of each named form
    forms_hit: Counter[str] = field(default_factory=Counter)
    negatives: Counter[str] = field(default_factory=Counter)  # texts per category
    negatives_flagged: Counter[str] = field(default_factory=Counter)  # ... with a span
    misses: list[Sample] = field(default_factory=list)
    flagged: list[str] = field(default_factory=list)  # "LABEL: text" of each false positive

    def recall(self, label: str | None = None) -> float:
        t = sum(self.tp.values()) if label is None else self.tp[label]
        f = sum(self.fn.values()) if label is None else self.fn[label]
        return t / (t + f) if t + f else 1.0

    def precision(self, label: str | None = None) -> float:
        t = sum(self.tp.values()) if label is None else self.tp[label]
        p = sum(self.fp.values()) if label is None else self.fp[label]
        return t / (t + p) if t + p else 1.0


def score(find: Callable[[str], Sequence[Span]]) -> Scores:
    """A positive is found when a span of its label covers its secret; every other span,
    on a positive or a negative, is a false positive of its label."""
    scores = Scores()
    for sample in positives():
        spans = find(sample.text)
        hit = [s for s in spans if sample.secret in sample.text[s.start:s.end]]
        found = any(s.label == sample.label for s in hit)
        (scores.tp if found else scores.fn)[sample.label] += 1
        if not found:
            scores.misses.append(sample)
        if sample.form:
            scores.forms[sample.form] += 1
            scores.forms_hit[sample.form] += found
        for s in spans:
            if s not in hit:
                scores.fp[s.label] += 1
                scores.flagged.append(f"{s.label}: {sample.text!r}")
    for category, texts in negatives().items():
        for text in texts:
            spans = find(text)
            scores.negatives[category] += 1
            scores.negatives_flagged[category] += bool(spans)
            for s in spans:
                scores.fp[s.label] += 1
                scores.flagged.append(f"{s.label}: {text!r}")
    return scores
