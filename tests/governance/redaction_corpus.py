"""A labelled corpus for the redaction engine: generated valid identifiers of every kind
(seeded, so the corpus is the same on every run), hand-picked real-world shapes, and
near misses that must stay untouched. Used by test_redaction.py and by
tests/bench/redaction_scores.py (precision and recall per recognizer)."""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass

from governance.redaction import IBAN_LENGTHS, luhn


@dataclass(frozen=True)
class Sample:
    text: str
    secret: str  # the substring that must vanish ("" for a negative)
    label: str  # the recognizer that must catch it ("" for a negative)


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
    return out


NEGATIVES: list[str] = [
    # SSN-shaped but invalid and unlabelled; dates; other groupings
    "000-12-3456", "666-45-6789", "900-12-3456", "123-00-4567", "123-45-0000",
    "1234-56-789", "12-345-6789", "order 123456789 shipped", "2026-12-03",
    # IBAN near misses: wrong check digits, wrong length, unknown country, prose
    "DE89 3704 0044 0532 0130 01", "DE8937040044053201300", "XX12 3456 7890 1234 56",
    "GB82 WEST 1234 5698 7654 33", "ID12345678901234 is a serial",
    # cards: Luhn fails, no issuer, too short, mixed separators
    "4111 1111 1111 1112", "1234 5678 9012 3452", "4111 1111 111", "4111-1111 1111 1111",
    "0000 0000 0000 0000", "tracking 9400111202555842761534",
    # emails
    "user@localhost", "user@@example.com", "@example.com", "name at example dot com",
    "user@example.", "see @mentions", "a@b.c",
    # phones
    "12345", "1 2 3 4 5 6 7", "call 555-2671", "123-456-7890", "version 1.2.3",
    "ISBN 978", "12:30 pm", "room 101",
    # IPs
    "256.1.1.1", "1.2.3", "1.2.3.4.5", "a:b", "2001:db8:::1", "cafe", "deadbeef",
    # secrets
    "eyJhbGciOi", "eyJ.abc.def", "sk-short", "AKIA123", "task-force-one", "risk-management",
    "bearer bonds", "Bearer of bad news", "the bearer information", "skeleton-key",
    # placeholders stay as they are
    "[SSN] [IBAN] [CARD] [EMAIL] [PHONE] [IP] [JWT] [API_KEY] Bearer [TOKEN]",
]
