"""Upstream API keys at rest, and the per-tenant cache salt.

A key is stored sealed: Fernet (AES-128-CBC + HMAC-SHA256, from `cryptography`) under a
key derived with HKDF-SHA256 from Django's SECRET_KEY. SECRET_KEY_FALLBACKS, Django's
own rotation list, still open what older keys sealed; a new SECRET_KEY without the old
one among the fallbacks leaves stored upstream keys unopenable (`SecretUnavailable`):
set them again. The database, its dumps and backups hold only the sealed token and,
for people to recognise a key, its last four characters (`hint`).

In memory, a key is a `Secret`: its repr and str never show it (a traceback's locals,
an f-string in a log line, a debugger's view), only `reveal()` does, where a request
header is built.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

MAX_SECRET_LENGTH = 4096
_HINT_MIN_LENGTH = 16  # a shorter key would give away too much of itself in 4 characters


class SecretUnavailable(Exception):
    """A sealed key that none of the configured keys opens (SECRET_KEY changed)."""


class Secret:
    """A plaintext API key that does not print itself."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __repr__(self) -> str:
        return "Secret('********')"

    __str__ = __repr__

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a Secret is not pickled")  # nor sent to another process


def _derive(secret_key: str, purpose: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"sluice-upstream",
                info=purpose).derive(secret_key.encode())


@lru_cache(maxsize=8)
def _fernet(keys: tuple[str, ...]) -> MultiFernet:
    return MultiFernet([Fernet(base64.urlsafe_b64encode(_derive(k, b"secrets v1")))
                        for k in keys])


def _keys() -> tuple[str, ...]:
    return (str(settings.SECRET_KEY), *[str(k) for k in
                                        getattr(settings, "SECRET_KEY_FALLBACKS", ())])


def seal(plaintext: str) -> str:
    """The stored form of an API key (a Fernet token, ASCII)."""
    return _fernet(_keys()).encrypt(plaintext.encode()).decode("ascii")


def unseal(token: str) -> Secret:
    """The key a `seal` made (an empty Secret for ""), or SecretUnavailable."""
    if not token:
        return Secret("")
    try:
        return Secret(_fernet(_keys()).decrypt(token.encode("ascii")).decode())
    except (InvalidToken, UnicodeError):
        raise SecretUnavailable("The upstream's stored API key cannot be decrypted with "
                                "this SECRET_KEY (nor its fallbacks): set it again.") from None


def hint(plaintext: str) -> str:
    """What pages and the API show of a key: its last four characters, or nothing for
    a key too short to give them away safely."""
    return plaintext[-4:] if len(plaintext) >= _HINT_MIN_LENGTH else ""


@lru_cache(maxsize=8)
def _salt_key(secret_key: str) -> bytes:
    return _derive(secret_key, b"cache salt v1")


def cache_salt(tenant: str) -> str:
    """vLLM's `cache_salt` for a tenant: an HMAC of the tenant's id under a key only
    Sluice holds, so the upstream's prefix cache is shared within a tenant and never
    across tenants, and the salt tells the upstream nothing about who the tenant is."""
    digest = hmac.new(_salt_key(str(settings.SECRET_KEY)), tenant.encode(), hashlib.sha256)
    return digest.hexdigest()[:32]
