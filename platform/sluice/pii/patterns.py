"""What the redaction recognizers (platform/sluice/pii/redaction.py) check a candidate against:
the checksums and number plans of the identifiers, and the words around a number that
make an ambiguous one personal data.

- `luhn`, `card_issuer`: payment cards (Luhn, the issuer's prefix and lengths).
- `IBAN_LENGTHS`, `iban_valid`: IBANs (the country's exact length, mod-97).
- `ssn_valid`: a US SSN's area, group and serial are ones the SSA issues.
- `nanp_shape`: ten digits (or eleven after a 1) shaped like a North American number.
- `ssn_context(text, start, end)`: the number at text[start:end] is said to be an SSN,
  by a label just before it ("SSN", "SSN#", "social security no.", "ssn_",
  `"ssn": "`, "SocialSecurityNumber=") or just after it ("... is my SSN", "(SSN)").
- `phone_context(text, start, end)`: the number at text[start:end] follows a phone word
  ("phone", "tel", "mobile", "fax", "call me at", "reach me on", ...) or is followed
  by a phone noun ("(mobile)", "is my cell").
- `in_hex_identifier(text, start, end)`: text[start:end] is part of a hexadecimal
  identifier (an object id such as "file-2881cb...", a digest, a trace id, a UUID), so
  a digit run inside it that passes Luhn is chance, not a card.
- `quoted_alone(text, start, end)`: text[start:end] is the whole of a quoted string
  that is neither a key nor a key's value: "The model '536427151' does not exist" says
  nothing about the number but that someone typed it on its own, while
  `"customer_id": "536427151"` names what it is.

A label counts only when nothing but punctuation, spaces and a few linking words
("number", "no.", "is", "my", "at", ...) stand between it and the number: "SSN on
file: 536427151" is labelled, "SSN verified, order 123456789" is not. A placeholder
("[SSN]", "[PHONE]") is never a label, nor is a word glued to the end of one ("[IP]ssn":
before redaction another token was glued to that word). Since linking words and
punctuation are never redacted themselves, a label's verdict is the same before and
after redaction (which keeps `redact` idempotent). Every search runs in a window of at
most `_WINDOW` characters, so the cost per candidate is constant.
"""

from __future__ import annotations

import re


# -- checksums and number plans --------------------------------------------------------
def luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def card_issuer(digits: str) -> str | None:
    n, two, three, four = len(digits), int(digits[:2]), int(digits[:3]), int(digits[:4])
    six = int(digits[:6])
    if digits[0] == "4" and n in (13, 16, 19):
        return "visa"
    if (51 <= two <= 55 or 222100 <= six <= 272099) and n == 16:
        return "mastercard"
    if two in (34, 37) and n == 15:
        return "amex"
    if (four == 6011 or two == 65 or 644 <= three <= 649) and n in (16, 19):
        return "discover"
    if 3528 <= four <= 3589 and 16 <= n <= 19:
        return "jcb"
    if (two in (36, 38, 39) or 300 <= three <= 305) and 14 <= n <= 19:
        return "diners"
    if two == 62 and 16 <= n <= 19:
        return "unionpay"
    if (two == 50 or 56 <= two <= 69) and 12 <= n <= 19:
        return "maestro"
    return None


# Lengths by country (SWIFT IBAN registry).
IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22,
    "BH": 22, "BR": 29, "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22,
    "DK": 18, "DO": 28, "EE": 20, "EG": 29, "ES": 24, "FI": 18, "FO": 18, "FR": 27,
    "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28, "HR": 21, "HU": 28,
    "IE": 22, "IL": 23, "IQ": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20,
    "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "MC": 27, "MD": 24,
    "ME": 22, "MK": 19, "MR": 27, "MT": 31, "MU": 30, "NL": 18, "NO": 15, "PK": 24,
    "PL": 28, "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22, "SA": 24, "SC": 31,
    "SE": 24, "SI": 19, "SK": 24, "SM": 27, "ST": 25, "SV": 28, "TL": 23, "TN": 24,
    "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20,
}


def iban_valid(iban: str) -> bool:
    iban = iban.upper()
    if IBAN_LENGTHS.get(iban[:2]) != len(iban) or not iban[2:4].isdigit():
        return False
    moved = iban[4:] + iban[:4]
    number = "".join(str(int(ch, 36)) for ch in moved)
    return int(number) % 97 == 1


def ssn_valid(area: str, group: str, serial: str) -> bool:
    return (area != "000" and area != "666" and area[0] != "9" and group != "00"
            and serial != "0000")


def nanp_shape(digits: str) -> bool:
    """Ten digits (or eleven after the country code 1) whose area code starts with 2-9,
    as NANP's plan has it. The exchange is not checked, nor is the area code assigned
    (`phonenumbers` checks both): people write the fictional 555-123-4567 too."""
    if len(digits) == 11 and digits[0] == "1":
        digits = digits[1:]
    return len(digits) == 10 and digits.isdigit() and digits[0] not in "01"


# -- context labels --------------------------------------------------------------------
_WINDOW = 48  # characters searched beside a number for its label


def _link(words: str) -> str:
    """One piece of what may stand between a label and its number: a non-word character,
    an underscore, or one of `words` as a whole word."""
    return rf"(?:[^\w]|_|(?<![a-z])(?:{words})(?![a-z]))"


def _after(word: str) -> str:
    """A label just after a number: "... (SSN)", "... - mobile", "... is my SSN"."""
    return (r"(?i)[^\S\n]{0,3}(?:[(-][^\S\n]{0,3}"
            r"|(?:is|was)[^\S\n]{1,3}(?:(?:my|his|her|their|your|the|an?)[^\S\n]{1,3})?)?"
            rf"{word}(?![a-z\[])")  # "SSN[IP]": before redaction a token was glued to it


_NUMBER_WORD = r"(?:[\s_.-]{0,2}(?:numbers?|num|nos?|nr)(?![a-z]))?"
_SSN_WORD = (r"(?<![a-z\[\]])(?:ssns?|s\.s\.n\.?|ss\s?#|ss(?=[\s_.-]{0,2}(?:numbers?|nos?)\b)"
             rf"|soc(?:ial)?[\s_.-]{{0,2}}sec(?:urity)?){_NUMBER_WORD}")
_SSN_LINK = _link(r"is|was|of|on|file|reads|my|his|her|their|your|the")
_SSN_BEFORE = re.compile(rf"(?i){_SSN_WORD}{_SSN_LINK}{{0,16}}$")
_SSN_AFTER = re.compile(_after(_SSN_WORD))

_PHONE_NOUN = r"tele?phone|phone|tel|mobile|cell(?:phone)?|fax|whats[\s-]?app"
_PHONE_WORD = (rf"(?<![a-z\[\]])(?:{_PHONE_NOUN}|ph|mob|sms|call|dial|reach){_NUMBER_WORD}")
_PHONE_LINK = _link(r"is|me|us|him|her|them|at|on|my|our|his|their|your|the|home|work"
                    r"|office|mobile|cell")
_PHONE_BEFORE = re.compile(rf"(?i){_PHONE_WORD}{_PHONE_LINK}{{0,16}}$")
_PHONE_AFTER = re.compile(_after(rf"(?<![a-z\[\]])(?:{_PHONE_NOUN})"))


# Opening quote -> its closing one.
_QUOTES = {"'": "'", '"': '"', "`": "`", "\u2018": "\u2019", "\u201c": "\u201d",
           "\u00ab": "\u00bb"}
_KEY_BEFORE = re.compile(r"[:=][^\S\n]{0,3}$")  # the value of `"key": "..."`, `key='...'`
_KEY_AFTER = re.compile(r"[^\S\n]{0,3}[:=]")  # itself a key


def quoted_alone(text: str, start: int, end: int) -> bool:
    """Is text[start:end] the whole of a quoted string, neither a key nor a key's value?"""
    if start == 0 or end >= len(text):
        return False
    close = _QUOTES.get(text[start - 1])
    return (close is not None and text[end] == close
            and _KEY_BEFORE.search(text, max(0, start - 5), start - 1) is None
            and _KEY_AFTER.match(text, end + 1) is None)


def ssn_context(text: str, start: int, end: int) -> bool:
    """Is the number at text[start:end] labelled as an SSN, just before or just after?"""
    return (_SSN_BEFORE.search(text, max(0, start - _WINDOW), start) is not None
            or _SSN_AFTER.match(text, end, end + _WINDOW) is not None)


def phone_context(text: str, start: int, end: int) -> bool:
    """Does a phone word stand just before the number at text[start:end] ("tel", "call me
    at", "reach me on") or a phone noun just after it ("(mobile)", "is my cell")?"""
    return (_PHONE_BEFORE.search(text, max(0, start - _WINDOW), start) is not None
            or _PHONE_AFTER.match(text, end, end + _WINDOW) is not None)


_HEX = frozenset("0123456789abcdefABCDEF")
_HEX_RUN = 20  # hex characters in a row: longer than any card, shorter than an id's hex
_UUID_HEAD = re.compile(r"(?<![0-9A-Fa-f-])[0-9A-Fa-f]{8}-(?:[0-9A-Fa-f]{4}-){3}$")


def in_hex_identifier(text: str, start: int, end: int) -> bool:
    """Is the digit run text[start:end] inside a run of at least `_HEX_RUN` hexadecimal
    characters, or the last group of a UUID? Sluice's own ids ("file-" and 24 hex
    digits), digests and trace ids are such runs; a card is written on its own or beside
    a word, and no card is 20 characters long. At most `_HEX_RUN` characters are read on
    each side."""
    if not text[start:end].isdigit():  # grouped ("4111 1111 ..."): not part of a run
        return _UUID_HEAD.search(text, max(0, start - 24), start) is not None
    left = start
    while left > max(0, start - _HEX_RUN) and text[left - 1] in _HEX:
        left -= 1
    right = end
    while right < min(len(text), end + _HEX_RUN) and text[right] in _HEX:
        right += 1
    return (right - left >= _HEX_RUN
            or _UUID_HEAD.search(text, max(0, start - 24), start) is not None)
