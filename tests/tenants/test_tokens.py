"""Access tokens: the exchange works, and the RFC 8725 attack suite is refused with 401."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from datetime import timedelta
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from django.conf import settings

from tenants.roles import Role
from tenants.signing_keys import keyring
from tests.conftest import PASSWORD, ApiClient, Org, assert_openai_error

pytestmark = pytest.mark.django_db


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def raw_token(header: dict[str, Any], claims: dict[str, Any], sign: Any = None) -> str:
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
    signature = sign(signing_input.encode()) if sign else b""
    return f"{signing_input}.{b64(signature)}"


def claims_for(org: Org, role: Role = Role.TENANT_ADMIN, **overrides: Any) -> dict[str, Any]:
    member = org.members[role]
    now = int(time.time())
    claims = {
        "iss": settings.SLUICE_JWT_ISSUER, "aud": settings.SLUICE_JWT_AUDIENCE,
        "sub": member.subject, "iat": now, "nbf": now, "exp": now + 300,
        "tid": org.tenant.pk, "role": str(role), "mid": member.pk,
    }
    claims.update(overrides)
    return {k: v for k, v in claims.items() if v is not None}


def signed(claims: dict[str, Any], **header: Any) -> str:
    key = keyring().active()
    headers = {"kid": key.kid, "typ": "at+jwt", **header}
    return jwt.encode(claims, key.private_key, algorithm="ES256", headers=headers)


def me(token: str) -> Any:
    return ApiClient(token).get("/api/v1/me")


def test_valid_own_token_authenticates(alice: Org) -> None:
    response = me(signed(claims_for(alice)))
    assert response.status == 200
    assert response.body["role"] == "tenant_admin"
    assert response.body["method"] == "jwt"


def test_password_exchange_issues_a_working_token(alice: Org, anon: ApiClient) -> None:
    issued = anon.post("/v1/auth/token", {"grant_type": "password",
                                          "username": "alice-developer", "password": PASSWORD})
    assert issued.status == 200, issued.body
    assert issued.body["token_type"] == "Bearer"
    assert issued.body["expires_in"] == settings.SLUICE_JWT_ACCESS_TTL_S
    header = jwt.get_unverified_header(issued.body["access_token"])
    assert header["alg"] == "ES256" and header["typ"] == "at+jwt" and header["kid"]
    whoami = me(issued.body["access_token"])
    assert whoami.status == 200
    assert whoami.body == {**whoami.body, "tenant": "alice", "role": "developer"}


def test_wrong_password_is_401_without_saying_which_part(alice: Org, anon: ApiClient) -> None:
    for username in ("alice-developer", "nobody-at-all"):
        error = assert_openai_error(anon.post("/v1/auth/token", {
            "grant_type": "password", "username": username, "password": "wrong password!"}), 401)
        assert error["message"] == "Incorrect username or password."


def test_api_key_exchange_carries_scope_and_dies_with_the_key(alice: Org, anon: ApiClient) -> None:
    admin = alice.client(Role.TENANT_ADMIN)
    created = admin.post("/api/v1/keys", {"name": "ci", "role": "developer",
                                          "allowed_models": ["tiny"]})
    issued = anon.post("/v1/auth/token", {"grant_type": "api_key", "api_key": created.body["key"]})
    token = issued.body["access_token"]
    assert me(token).body["allowed_models"] == ["tiny"]
    admin.delete(f"/api/v1/keys/{created.body['id']}")
    assert_openai_error(me(token), 401)


def test_token_of_removed_member_stops_working(alice: Org) -> None:
    token = signed(claims_for(alice, Role.DEVELOPER))
    assert me(token).status == 200
    alice.client(Role.TENANT_ADMIN).delete(f"/api/v1/members/{alice.members[Role.DEVELOPER].pk}")
    assert_openai_error(me(token), 401)


def test_jwks_publishes_keys_that_verify_issued_tokens(alice: Org, anon: ApiClient) -> None:
    exchange = {"grant_type": "api_key", "api_key": alice.keys[Role.DEVELOPER]}
    token = anon.post("/v1/auth/token", exchange).body["access_token"]
    jwks = anon.get("/.well-known/jwks.json").body
    assert all("d" not in key for key in jwks["keys"]), "private part leaked"
    key = jwt.PyJWKSet.from_dict(jwks)[jwt.get_unverified_header(token)["kid"]]
    claims = jwt.decode(token, key.key, algorithms=["ES256"], audience=settings.SLUICE_JWT_AUDIENCE)
    assert claims["tid"] == alice.tenant.pk


def test_rotation_keeps_old_tokens_valid_until_pruned(alice: Org) -> None:
    old = signed(claims_for(alice))
    ring = keyring()
    new_key = ring.rotate()
    assert ring.active().kid == new_key.kid
    assert me(old).status == 200, "a rotation must not log everyone out"
    assert jwt.get_unverified_header(signed(claims_for(alice)))["kid"] == new_key.kid
    assert ring.prune(grace=timedelta(seconds=-1))  # pretend the grace period is over
    assert_openai_error(me(old), 401)


def test_each_rotation_makes_the_new_key_active_even_within_one_second(alice: Org) -> None:
    ring = keyring()
    for _ in range(8):  # several rotations a second: each kid must sort after the last
        new_key = ring.rotate()
        assert ring.active().kid == new_key.kid
        assert jwt.get_unverified_header(signed(claims_for(alice)))["kid"] == new_key.kid


# -- the attack suite ------------------------------------------------------------------
def _public_pem() -> bytes:
    return keyring().active().public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _attacks(org: Org) -> dict[str, str]:
    good = claims_for(org)
    kid = keyring().active().kid
    hs_key = _public_pem()
    attacker = ec.generate_private_key(ec.SECP256R1())
    attacker_jwk = jwt.algorithms.ECAlgorithm.to_jwk(attacker.public_key(), as_dict=True)
    now = int(time.time())
    leeway = settings.SLUICE_JWT_LEEWAY_S
    return {
        "alg none": raw_token({"alg": "none", "typ": "at+jwt", "kid": kid}, good),
        "alg None": raw_token({"alg": "None", "typ": "at+jwt", "kid": kid}, good),
        "alg nOnE": raw_token({"alg": "nOnE", "typ": "at+jwt", "kid": kid}, good),
        "HS256 signed with the public key": raw_token(
            {"alg": "HS256", "typ": "at+jwt", "kid": kid}, good,
            lambda data: hmac.new(hs_key, data, hashlib.sha256).digest()),
        "expired beyond leeway": signed({**good, "iat": now - 1000,
                                         "exp": now - leeway - 5}),
        "nbf in the future": signed({**good, "nbf": now + leeway + 60}),
        "iat in the future": signed({**good, "iat": now + leeway + 60}),
        "wrong aud": signed({**good, "aud": "someone-else"}),
        "missing aud": signed(claims_for(org, aud=None)),
        "missing exp": signed(claims_for(org, exp=None)),
        "missing iat": signed(claims_for(org, iat=None)),
        "missing sub": signed(claims_for(org, sub=None)),
        "missing iss": signed(claims_for(org, iss=None)),
        "issuer prefix match": signed({**good, "iss": settings.SLUICE_JWT_ISSUER + ".evil.com"}),
        "issuer as prefix": signed({**good, "iss": settings.SLUICE_JWT_ISSUER[:-1]}),
        "kid path traversal": signed(good, kid="../../../../etc/passwd"),
        "kid SQL injection": signed(good, kid="x' OR '1'='1"),
        "kid unknown": signed(good, kid="does-not-exist"),
        "kid missing": raw_token({"alg": "ES256", "typ": "at+jwt"}, good,
                                 lambda d: b"\x00" * 64),
        "unknown crit": signed(good, crit=["exp-check"], **{"exp-check": True}),
        "refresh typ header": signed(good, typ="refresh+jwt"),
        "refresh typ claim": signed({**good, "typ": "Refresh"}),
        "plain JWT typ for own issuer": signed(good, typ="JWT"),
        "id token typ": signed(good, typ="id+jwt"),
        "embedded jwk header (attacker's key)": jwt.encode(
            good, attacker, algorithm="ES256",
            headers={"kid": kid, "typ": "at+jwt", "jwk": attacker_jwk}),
        "jku header to attacker": jwt.encode(
            good, attacker, algorithm="ES256",
            headers={"kid": kid, "typ": "at+jwt", "jku": "http://127.0.0.1:1/jwks.json"}),
        "tampered payload": (lambda t: t.split(".")[0] + "." + b64(json.dumps(
            {**good, "role": "platform_admin"}).encode()) + "." + t.split(".")[2])(signed(good)),
        "garbage": "not-a-jwt-at-all",
        "three dots of nothing": "..",
        "oversized": signed({**good, "pad": "x" * 10_000}),
    }


# attack -> the reason the 401 must give (so each case fails for its own reason)
EXPECTED_REASON = {
    "alg none": "algorithm not allowed", "alg None": "algorithm not allowed",
    "alg nOnE": "algorithm not allowed",
    "HS256 signed with the public key": "algorithm not allowed",
    "expired beyond leeway": "expired", "nbf in the future": "not valid yet",
    "iat in the future": "not valid yet", "wrong aud": "wrong audience",
    "missing aud": "missing claim aud", "missing exp": "missing claim exp",
    "missing iat": "missing claim iat", "missing sub": "missing claim sub",
    "missing iss": "untrusted issuer", "issuer prefix match": "untrusted issuer",
    "issuer as prefix": "untrusted issuer", "kid path traversal": "malformed kid",
    "kid SQL injection": "malformed kid", "kid unknown": "unknown signing key",
    "kid missing": "malformed kid", "unknown crit": "malformed",
    "refresh typ header": "not an access token", "refresh typ claim": "not an access token",
    "plain JWT typ for own issuer": "wrong token type", "id token typ": "not an access token",
    "embedded jwk header (attacker's key)": "bad signature",
    "jku header to attacker": "bad signature", "tampered payload": "bad signature",
    "garbage": "malformed", "three dots of nothing": "malformed", "oversized": "too long",
}
ATTACK_NAMES = sorted(EXPECTED_REASON)


@pytest.mark.parametrize("attack", ATTACK_NAMES)
def test_attack_is_refused_with_401(alice: Org, attack: str) -> None:
    token = _attacks(alice)[attack]
    error = assert_openai_error(me(token), 401)
    assert error["type"] == "authentication_error"
    assert EXPECTED_REASON[attack] in error["message"]
    assert token not in error["message"]


def test_attack_table_covers_every_case(alice: Org) -> None:
    assert sorted(_attacks(alice)) == sorted(ATTACK_NAMES)


def test_expiry_within_leeway_is_accepted(alice: Org) -> None:
    now = int(time.time())
    token = signed({**claims_for(alice), "iat": now - 100, "exp": now - 5})
    assert me(token).status == 200
