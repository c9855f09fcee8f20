"""API key format: `sk-sluice-<prefix>-<secret>`.

The prefix (10 lowercase alphanumerics) is the lookup handle and is shown in listings;
the secret is 256 bits from `secrets`. Only the SHA-256 of the whole key is stored: a key
has enough entropy that a slow password hash would only cost latency on the hot path.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
from dataclasses import dataclass

KEY_MARKER = "sk-sluice-"
PREFIX_LEN = 10
_PREFIX_ALPHABET = string.ascii_lowercase + string.digits
_MAX_KEY_LEN = 200


@dataclass(frozen=True, slots=True)
class ParsedKey:
    prefix: str
    full: str


def generate() -> tuple[str, str, str]:
    """A new key: (full key to show once, prefix, hash to store)."""
    prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(PREFIX_LEN))
    full = f"{KEY_MARKER}{prefix}-{secrets.token_urlsafe(32)}"
    return full, prefix, hash_key(full)


def looks_like_key(token: str) -> bool:
    return token.startswith(KEY_MARKER)


def parse(token: str) -> ParsedKey | None:
    if not looks_like_key(token) or len(token) > _MAX_KEY_LEN:
        return None
    rest = token[len(KEY_MARKER):]
    prefix, sep, secret = rest[:PREFIX_LEN], rest[PREFIX_LEN:PREFIX_LEN + 1], rest[PREFIX_LEN + 1:]
    if sep != "-" or not secret or any(c not in _PREFIX_ALPHABET for c in prefix):
        return None
    return ParsedKey(prefix=prefix, full=token)


def hash_key(full: str) -> str:
    return hashlib.sha256(full.encode()).hexdigest()


def matches(full: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_key(full), stored_hash)


def display(prefix: str) -> str:
    return f"{KEY_MARKER}{prefix}-…"
