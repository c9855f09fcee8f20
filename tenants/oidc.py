"""External OIDC issuers whose access tokens Sluice accepts (the Azure AD groups case).

Configured by SLUICE_OIDC_ISSUERS, a JSON list of objects:

    {"issuer": "https://login.example.com/tenant-x/v2.0",   exact match on `iss`
     "audience": "api://sluice",                              required `aud`
     "jwks_file": "/etc/sluice/idp-jwks.json"  or  "jwks_url": "https://.../keys",
     "algorithms": ["RS256"],                                 allow-list, no HS*/none
     "tenant_claim": "tid", "tenant_map": {"<tid>": "acme"},  claim value -> tenant slug
     "roles_claim": "groups", "role_map": {"<group-id>": "tenant_admin"},
     "allowed_typ": ["JWT", "at+jwt"]}

Keys come only from the configured file or URL, never from a token's jku/x5u/jwk header.
A URL is fetched with a timeout, cached, and refetched on an unknown `kid` at most once a
minute (so a flood of forged kids cannot turn into a flood of fetches).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from tenants.roles import Role

_ASYMMETRIC = {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512",
               "EdDSA"}
_JWKS_TTL_S = 3600.0
_JWKS_MIN_REFETCH_S = 60.0
_FETCH_TIMEOUT_S = 5.0


@dataclass
class ExternalIssuer:
    issuer: str
    audience: str
    algorithms: list[str]
    tenant_claim: str
    roles_claim: str
    role_map: dict[str, Role]
    tenant_map: dict[str, str] | None = None
    jwks_file: Path | None = None
    jwks_url: str | None = None
    allowed_typ: frozenset[str] = frozenset({"jwt", "at+jwt", "application/at+jwt"})
    _keys: dict[str, jwt.PyJWK] = field(default_factory=dict, repr=False)
    _loaded_at: float = field(default=0.0, repr=False)
    _file_stamp: int | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> ExternalIssuer:
        def need(name: str) -> Any:
            if not raw.get(name):
                raise ImproperlyConfigured(f"SLUICE_OIDC_ISSUERS entry lacks {name!r}")
            return raw[name]

        algorithms = list(raw.get("algorithms") or ["RS256"])
        bad = [a for a in algorithms if a not in _ASYMMETRIC]
        if bad:
            raise ImproperlyConfigured(f"OIDC issuer algorithms must be asymmetric, not {bad}")
        if bool(raw.get("jwks_file")) == bool(raw.get("jwks_url")):
            raise ImproperlyConfigured("OIDC issuer needs exactly one of jwks_file, jwks_url")
        try:
            role_map = {str(k): Role(v) for k, v in dict(need("role_map")).items()}
        except ValueError as exc:
            raise ImproperlyConfigured(f"OIDC role_map: {exc}") from None
        return cls(
            issuer=need("issuer"),
            audience=need("audience"),
            algorithms=algorithms,
            tenant_claim=raw.get("tenant_claim", "tid"),
            roles_claim=raw.get("roles_claim", "groups"),
            role_map=role_map,
            tenant_map=raw.get("tenant_map"),
            jwks_file=Path(raw["jwks_file"]) if raw.get("jwks_file") else None,
            jwks_url=raw.get("jwks_url"),
            allowed_typ=frozenset(t.lower() for t in raw.get("allowed_typ", ["JWT", "at+jwt"])),
        )

    # -- keys ----------------------------------------------------------------------
    def key_for(self, kid: str) -> jwt.PyJWK | None:
        self._refresh(force=False)
        key = self._keys.get(kid)
        if key is None and self.jwks_url:
            self._refresh(force=True)  # rotated at the IdP? refetch, rate-limited
            key = self._keys.get(kid)
        return key

    def _refresh(self, *, force: bool) -> None:
        now = time.monotonic()
        with self._lock:
            if self.jwks_file is not None:
                stamp = self.jwks_file.stat().st_mtime_ns
                if stamp != self._file_stamp:
                    self._keys = _parse_jwks(json.loads(self.jwks_file.read_bytes()))
                    self._file_stamp = stamp
                return
            age = now - self._loaded_at
            if self._loaded_at and age < _JWKS_TTL_S and not (force and age > _JWKS_MIN_REFETCH_S):
                return
            self._loaded_at = now
            # On failure keep the keys we had: an IdP outage must not log everyone out.
            with contextlib.suppress(OSError, ValueError):
                self._keys = _parse_jwks(_fetch_json(str(self.jwks_url)))

    # -- claims --------------------------------------------------------------------
    def tenant_slug(self, claims: dict[str, Any]) -> str | None:
        value = claims.get(self.tenant_claim)
        if not isinstance(value, str):
            return None
        if self.tenant_map is not None:
            return self.tenant_map.get(value)
        return value

    def roles(self, claims: dict[str, Any]) -> list[Role]:
        value = claims.get(self.roles_claim)
        values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        return [self.role_map[v] for v in values if isinstance(v, str) and v in self.role_map]


def _parse_jwks(data: Any) -> dict[str, jwt.PyJWK]:
    keys: dict[str, jwt.PyJWK] = {}
    for entry in (data or {}).get("keys", []):
        if not isinstance(entry, dict) or entry.get("kty") == "oct":
            continue  # symmetric keys are never trusted from a JWKS
        try:
            key = jwt.PyJWK(entry)
        except jwt.PyJWTError:
            continue
        if key.key_id:
            keys[key.key_id] = key
    return keys


def _fetch_json(url: str) -> Any:
    if not url.startswith(("https://", "http://")):
        raise ValueError("jwks_url must be http(s)")
    with urllib.request.urlopen(url, timeout=_FETCH_TIMEOUT_S) as response:  # noqa: S310
        return json.loads(response.read(1024 * 1024))


_issuers: dict[str, ExternalIssuer] | None = None
_issuers_source: Any = None


def external_issuers() -> dict[str, ExternalIssuer]:
    """Configured issuers by exact `iss` value (re-read if the settings object changed)."""
    global _issuers, _issuers_source
    raw = settings.SLUICE_OIDC_ISSUERS
    if _issuers is None or _issuers_source is not raw:
        _issuers = {cfg["issuer"]: ExternalIssuer.from_config(cfg) for cfg in raw or []}
        _issuers_source = raw
    return _issuers
