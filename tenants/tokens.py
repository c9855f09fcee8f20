"""Access tokens: issued by the platform, verified for it and for trusted OIDC issuers.

Verification follows RFC 8725 (JWT best current practices):
- the algorithm comes from an explicit allow-list, and must match the key's type, so
  `alg: none` and HS256-signed-with-the-public-key are refused before any crypto;
- exp, iat, iss, aud and sub are required; nbf and exp are checked with a small leeway;
- the issuer must match exactly (no prefix or suffix games), and picks the key set;
- `kid` must look like a kid and is only ever a dictionary key (no path, no SQL);
- jku, x5u, x5c and jwk headers are never read: keys come from configuration only;
- any `crit` header is refused (we implement no critical extensions);
- `typ` must be an access-token type; refresh and ID tokens are refused.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

import jwt
from django.conf import settings

from sluice.errors import Unauthenticated
from tenants.oidc import ExternalIssuer, external_issuers
from tenants.signing_keys import KID_PATTERN, keyring

OWN_TOKEN_TYP = "at+jwt"  # noqa: S105 - the RFC 9068 media type, not a secret
_MAX_TOKEN_LEN = 8192
_REFRESH_OR_ID = {"refresh", "refresh+jwt", "id", "id+jwt", "logout+jwt"}
_ALG_FOR_KTY = {"EC": {"ES256", "ES384", "ES512"},
                "RSA": {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"},
                "OKP": {"EdDSA"}}


@dataclass(frozen=True, slots=True)
class IssuedToken:
    access_token: str
    expires_in: int


@dataclass(frozen=True, slots=True)
class VerifiedToken:
    claims: dict[str, Any]
    external: ExternalIssuer | None  # None: the platform's own token


def issue_access_token(
    *,
    subject: str,
    tenant_id: int,
    role: str,
    member_id: int | None,
    key_id: int | None,
    allowed_models: list[str] | None,
    ttl_s: int | None = None,
) -> IssuedToken:
    key = keyring().active()
    now = int(time.time())
    ttl = ttl_s or settings.SLUICE_JWT_ACCESS_TTL_S
    claims: dict[str, Any] = {
        "iss": settings.SLUICE_JWT_ISSUER,
        "aud": settings.SLUICE_JWT_AUDIENCE,
        "sub": subject,
        "iat": now,
        "nbf": now,
        "exp": now + ttl,
        "jti": secrets.token_urlsafe(12),
        "tid": tenant_id,
        "role": role,
    }
    if member_id is not None:
        claims["mid"] = member_id
    if key_id is not None:
        claims["kid_api"] = key_id
    if allowed_models is not None:
        claims["models"] = list(allowed_models)
    token = jwt.encode(
        claims, key.private_key, algorithm=key.alg, headers={"kid": key.kid, "typ": OWN_TOKEN_TYP}
    )
    return IssuedToken(access_token=token, expires_in=ttl)


def _invalid(reason: str) -> Unauthenticated:
    return Unauthenticated(f"Invalid access token: {reason}.", code="invalid_token")


def verify_access_token(token: str) -> VerifiedToken:
    """Verify a bearer JWT or raise Unauthenticated (never anything else)."""
    if len(token) > _MAX_TOKEN_LEN:
        raise _invalid("too long")
    try:
        header = jwt.get_unverified_header(token)
        unverified = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        raise _invalid("malformed") from None
    if "crit" in header:
        raise _invalid("unsupported critical header")
    alg, kid, typ = header.get("alg"), header.get("kid"), header.get("typ")
    if not isinstance(kid, str) or not KID_PATTERN.match(kid):
        raise _invalid("missing or malformed kid")
    if _is_refresh_or_id(typ) or _is_refresh_or_id(unverified.get("typ")):
        raise _invalid("not an access token")
    if unverified.get("token_use") not in (None, "access"):
        raise _invalid("not an access token")

    issuer = unverified.get("iss")
    external = external_issuers().get(issuer) if isinstance(issuer, str) else None
    if external is not None:
        algorithms, audience = external.algorithms, external.audience
        allowed_typ: frozenset[str] = external.allowed_typ
        jwk = external.key_for(kid)
        verify_key = jwk.key if jwk is not None else None
        kty = jwk.key_type if jwk is not None else None
    elif issuer == settings.SLUICE_JWT_ISSUER:
        algorithms, audience = settings.SLUICE_JWT_ALGORITHMS, settings.SLUICE_JWT_AUDIENCE
        allowed_typ = frozenset({OWN_TOKEN_TYP})
        own = keyring().get(kid)
        verify_key = own.public_key if own is not None else None
        kty = ("EC" if own.alg.startswith("ES") else "RSA") if own is not None else None
    else:
        raise _invalid("untrusted issuer")

    if not isinstance(typ, str) or typ.lower() not in allowed_typ:
        raise _invalid("wrong token type")
    if alg not in algorithms:
        raise _invalid("algorithm not allowed")
    if verify_key is None:
        raise _invalid("unknown signing key")
    if alg not in _ALG_FOR_KTY.get(str(kty), set()):
        raise _invalid("algorithm does not match the key")
    try:
        claims = jwt.decode(
            token,
            key=verify_key,
            algorithms=[alg],
            audience=audience,
            issuer=issuer,
            leeway=settings.SLUICE_JWT_LEEWAY_S,
            options={"require": ["exp", "iat", "iss", "aud", "sub"], "strict_aud": False},
        )
    except jwt.ExpiredSignatureError:
        raise Unauthenticated("Access token has expired.", code="token_expired") from None
    except jwt.ImmatureSignatureError:
        raise _invalid("not valid yet") from None
    except jwt.InvalidAudienceError:
        raise _invalid("wrong audience") from None
    except jwt.MissingRequiredClaimError as exc:
        raise _invalid(f"missing claim {exc.claim}") from None
    except jwt.PyJWTError:
        raise _invalid("bad signature or claims") from None
    if not isinstance(claims.get("sub"), str) or not claims["sub"]:
        raise _invalid("bad subject")
    return VerifiedToken(claims=claims, external=external)


def _is_refresh_or_id(value: object) -> bool:
    return isinstance(value, str) and value.lower() in _REFRESH_OR_ID
