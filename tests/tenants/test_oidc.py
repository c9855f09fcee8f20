"""Tokens from a trusted external OIDC issuer (the Azure AD groups case)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from django.core.exceptions import ImproperlyConfigured

from tenants.oidc import ExternalIssuer
from tests.conftest import ApiClient, Org, assert_openai_error

pytestmark = pytest.mark.django_db

ISSUER = "https://idp.example.test/tenant-x/v2.0"
AUDIENCE = "api://sluice"


def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def jwks_of(*pairs: tuple[str, rsa.RSAPrivateKey]) -> dict[str, Any]:
    return {"keys": [{**jwt.algorithms.RSAAlgorithm.to_jwk(k.public_key(), as_dict=True),
                      "kid": kid, "alg": "RS256", "use": "sig"} for kid, k in pairs]}


def idp_token(key: rsa.RSAPrivateKey, kid: str = "idp-1", **claims: Any) -> str:
    now = int(time.time())
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "00u-abc", "iat": now, "exp": now + 600,
            "tid": "tid-alice", "groups": ["g-devs"], **claims}
    body = {k: v for k, v in body.items() if v is not None}
    return jwt.encode(body, key, algorithm="RS256", headers={"kid": kid, "typ": "JWT"})


def config(**source: str) -> list[dict[str, Any]]:
    return [{"issuer": ISSUER, "audience": AUDIENCE, "algorithms": ["RS256"],
             "tenant_claim": "tid", "tenant_map": {"tid-alice": "alice", "tid-bob": "bob"},
             "roles_claim": "groups",
             "role_map": {"g-admins": "tenant_admin", "g-devs": "developer",
                          "g-audit": "auditor"},
             **source}]


@pytest.fixture
def idp_key(settings: Any, tmp_path: Path) -> rsa.RSAPrivateKey:
    key = rsa_key()
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps(jwks_of(("idp-1", key))))
    settings.SLUICE_OIDC_ISSUERS = config(jwks_file=str(path))
    return key


def me(token: str) -> Any:
    return ApiClient(token).get("/api/v1/me")


def test_groups_claim_maps_to_tenant_and_strongest_role(alice: Org, idp_key: Any) -> None:
    response = me(idp_token(idp_key, groups=["g-unrelated", "g-devs", "g-admins"]))
    assert response.status == 200, response.body
    assert response.body["tenant"] == "alice"
    assert response.body["role"] == "tenant_admin"
    assert response.body["method"] == "oidc"
    assert response.body["subject"] == f"oidc:{ISSUER}|00u-abc"


def test_external_principal_gets_the_same_rbac(alice: Org, idp_key: Any) -> None:
    token = idp_token(idp_key, groups=["g-audit"])
    assert_openai_error(ApiClient(token).get("/api/v1/members"), 403)
    created = ApiClient(token).post("/api/v1/keys", {"name": "auditor tooling"})
    assert created.status == 201 and created.body["role"] == "auditor"


def test_no_mapped_group_is_forbidden(alice: Org, idp_key: Any) -> None:
    assert_openai_error(me(idp_token(idp_key, groups=["g-unrelated"])), 403)


def test_unknown_tenant_claim_is_refused(alice: Org, idp_key: Any) -> None:
    assert_openai_error(me(idp_token(idp_key, tid="tid-mallory")), 401)
    assert_openai_error(me(idp_token(idp_key, tid=None)), 401)


def test_other_key_with_same_kid_is_refused(alice: Org, idp_key: Any) -> None:
    error = assert_openai_error(me(idp_token(rsa_key())), 401)
    assert "bad signature" in error["message"]


def test_external_token_needs_audience_and_expiry(alice: Org, idp_key: Any) -> None:
    assert_openai_error(me(idp_token(idp_key, aud="api://other")), 401)
    assert_openai_error(me(idp_token(idp_key, exp=None)), 401)


def test_refresh_tokens_of_the_idp_are_refused(alice: Org, idp_key: Any) -> None:
    assert_openai_error(me(idp_token(idp_key, typ="Refresh")), 401)
    assert_openai_error(me(idp_token(idp_key, token_use="id")), 401)


def test_symmetric_algorithms_cannot_be_configured() -> None:
    with pytest.raises(ImproperlyConfigured):
        ExternalIssuer.from_config({**config(jwks_file="/x")[0], "algorithms": ["HS256"]})
    with pytest.raises(ImproperlyConfigured):
        ExternalIssuer.from_config(config()[0])  # no key source


@pytest.fixture
def jwks_server() -> Iterator[tuple[str, dict[str, Any], list[int]]]:
    """A loopback JWKS endpoint; the test changes `document`; `hits` counts fetches."""
    document: dict[str, Any] = {"keys": []}
    hits: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(1)
            body = json.dumps(document).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/keys", document, hits
    server.shutdown()


def test_jwks_url_is_fetched_and_cached(alice: Org, settings: Any, jwks_server: Any) -> None:
    url, document, hits = jwks_server
    key = rsa_key()
    document.update(jwks_of(("idp-1", key)))
    settings.SLUICE_OIDC_ISSUERS = config(jwks_url=url)
    assert me(idp_token(key)).status == 200
    assert me(idp_token(key)).status == 200
    assert len(hits) == 1, "the JWKS must be cached, not fetched per request"
    # Forged kids must not turn into a fetch each: at most one refetch a minute.
    for n in range(5):
        assert_openai_error(me(idp_token(key, kid=f"forged-{n}")), 401)
    assert len(hits) == 1
