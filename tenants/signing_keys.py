"""The platform's own JWT signing keys: a directory of PEM files, one per `kid`.

The newest key signs; every key still in the directory verifies and is published in the
JWKS, so rotation is: add a key (`manage.py rotatejwtkeys`), let tokens signed by the old
one expire, then prune it. Every gateway process re-reads the directory when its mtime
changes, so a rotation reaches all of them without a restart. In Kubernetes the
directory is a mounted Secret.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from django.conf import settings
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

KID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_KID_TIME_FORMAT = "%Y%m%dT%H%M%S"
_PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
_PublicKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey


@dataclass(frozen=True, slots=True)
class SigningKey:
    kid: str
    alg: str
    private_key: _PrivateKey
    created_at: datetime

    @property
    def public_key(self) -> _PublicKey:
        return self.private_key.public_key()

    def public_jwk(self) -> dict[str, Any]:
        public = self.public_key
        if isinstance(public, ec.EllipticCurvePublicKey):
            jwk = ECAlgorithm.to_jwk(public, as_dict=True)
        else:
            jwk = RSAAlgorithm.to_jwk(public, as_dict=True)
        return {**jwk, "kid": self.kid, "alg": self.alg, "use": "sig"}


def _alg_for(key: _PrivateKey) -> str:
    return "ES256" if isinstance(key, ec.EllipticCurvePrivateKey) else "RS256"


class KeyRing:
    def __init__(self, directory: Path, signing_alg: str) -> None:
        if signing_alg not in {"ES256", "RS256"}:
            raise ValueError(f"unsupported signing algorithm {signing_alg!r}")
        self.directory = directory
        self.signing_alg = signing_alg
        self._lock = threading.Lock()
        self._stamp: int | None = None
        self._keys: dict[str, SigningKey] = {}

    # -- reading -------------------------------------------------------------------
    def _load(self) -> dict[str, SigningKey]:
        try:
            stamp = self.directory.stat().st_mtime_ns
        except FileNotFoundError:
            stamp = None
        if stamp is not None and stamp == self._stamp:
            return self._keys
        with self._lock:
            keys: dict[str, SigningKey] = {}
            for path in sorted(self.directory.glob("*.pem")) if stamp else []:
                kid = path.stem
                if not KID_PATTERN.match(kid):
                    continue
                private = serialization.load_pem_private_key(path.read_bytes(), password=None)
                if not isinstance(private, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
                    continue
                keys[kid] = SigningKey(kid, _alg_for(private), private, _created_at(kid))
            self._keys, self._stamp = keys, stamp
            return keys

    def get(self, kid: str) -> SigningKey | None:
        return self._load().get(kid)

    def all(self) -> list[SigningKey]:
        return sorted(self._load().values(), key=lambda k: k.kid)

    def active(self) -> SigningKey:
        keys = self.all()
        return keys[-1] if keys else self.rotate()

    def jwks(self) -> dict[str, Any]:
        return {"keys": [key.public_jwk() for key in self.all()]}

    # -- writing -------------------------------------------------------------------
    def rotate(self) -> SigningKey:
        """Create a new key; it becomes the active one. Old keys keep verifying."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        now = datetime.now(UTC)
        kid = f"{now.strftime(_KID_TIME_FORMAT)}-{secrets.token_hex(4)}"
        newest = max(self._load(), default="")
        if kid <= newest:
            # Made in the same second as the newest key (or with the clock set back): the
            # active key is the last in order, so this one must sort after that one.
            kid = f"{newest}{secrets.token_hex(2)}"
        private: _PrivateKey
        if self.signing_alg == "ES256":
            private = ec.generate_private_key(ec.SECP256R1())
        else:
            private = rsa.generate_private_key(public_exponent=65537, key_size=3072)
        pem = private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # Write under a temporary name, then rename: readers never see half a key.
        tmp = self.directory / f".{kid}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(pem)
        tmp.rename(self.directory / f"{kid}.pem")
        return SigningKey(kid, _alg_for(private), private, now)

    def prune(self, *, grace: timedelta) -> list[str]:
        """Delete keys that stopped signing more than `grace` ago (never the active one)."""
        keys = self.all()
        removed = []
        now = datetime.now(UTC)
        for older, newer in itertools.pairwise(keys):
            if newer.created_at < now - grace:
                (self.directory / f"{older.kid}.pem").unlink(missing_ok=True)
                removed.append(older.kid)
        return removed


def _created_at(kid: str) -> datetime:
    try:
        return datetime.strptime(kid.split("-", 1)[0], _KID_TIME_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        return datetime.fromtimestamp(0, UTC)


_keyring: KeyRing | None = None


def keyring() -> KeyRing:
    global _keyring
    directory = Path(settings.SLUICE_JWT_KEYS_DIR)
    if _keyring is None or _keyring.directory != directory:
        _keyring = KeyRing(directory, settings.SLUICE_JWT_SIGNING_ALG)
    return _keyring

