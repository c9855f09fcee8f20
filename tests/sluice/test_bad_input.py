"""Bad input gets a clear, typed 4xx in OpenAI's error shape: never a 500 or a trace."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.conf import settings

from tenants.models import ApiKey, Member, Tenant
from tenants.roles import Role
from tests.conftest import Org, assert_openai_error

pytestmark = pytest.mark.django_db


def counts() -> tuple[int, int, int]:
    return Tenant.objects.count(), Member.objects.count(), ApiKey.objects.count()


def test_malformed_json_is_400(alice: Org) -> None:
    error = assert_openai_error(alice.client(Role.TENANT_ADMIN).post(
        "/api/v1/keys", raw=b'{"name": "x",'), 400)
    assert error["code"] == "invalid_json"


def test_oversized_body_is_413_before_parsing(alice: Org) -> None:
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    body = json.dumps({"name": "x" * (limit + 10)}).encode()
    before = counts()
    error = assert_openai_error(alice.client(Role.TENANT_ADMIN).post("/api/v1/keys", raw=body),
                                413)
    assert str(limit) in error["message"]
    assert counts() == before


def test_unknown_field_is_422_naming_it(alice: Org) -> None:
    error = assert_openai_error(alice.client(Role.TENANT_ADMIN).post(
        "/api/v1/keys", {"name": "x", "colour": "red"}), 422)
    assert error["param"] == "colour" and "colour" in error["message"]


def test_missing_field_is_422_naming_it(alice: Org) -> None:
    error = assert_openai_error(alice.client(Role.TENANT_ADMIN).post("/api/v1/keys", {}), 422)
    assert error["param"] == "name" and error["code"] == "missing_field"


def test_bad_content_length_is_400(alice: Org) -> None:
    response = alice.client(Role.TENANT_ADMIN).client.generic(
        "POST", "/api/v1/keys", b"{}", content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {alice.keys[Role.TENANT_ADMIN]}", CONTENT_LENGTH="abc")
    assert response.status_code == 400


WEIRD_BODIES: list[Any] = [
    None, [], "a string", 42, {"name": 12}, {"name": ""}, {"name": "x" * 300},
    {"name": ["x"]}, {"name": {"$ne": 1}}, {"role": "god"}, {"role": 7},
    {"expires_at": "yesterday"}, {"allowed_models": "tiny"}, {"allowed_models": [1, 2]},
    {"allowed_models": ["m"] * 101}, {"slug": "UPPER CASE"}, {"username": "a b c"},
    {"email": "not-an-email"}, {"password": "x" * 600}, {"is_active": "maybe"},
    {"grant_type": "magic"}, {"grant_type": "api_key"}, {"grant_type": "password"},
    {"grant_type": "api_key", "api_key": "sk-sluice-" + "a" * 400},
    {"grant_type": "api_key", "api_key": "sk-sluice-short"},
    {"a": {"b": {"c": {"d": {"e": {"f": [[[[[[[[[[1]]]]]]]]]]}}}}}},
]
ENDPOINTS = [("POST", "/api/v1/keys"), ("POST", "/api/v1/members"), ("POST", "/api/v1/tenants"),
             ("PATCH", "/api/v1/members/{member}"), ("PATCH", "/api/v1/tenants/{tenant}"),
             ("POST", "/v1/auth/token")]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_weird_bodies_never_500(ops: Org, method: str, path: str) -> None:
    client = ops.client(Role.PLATFORM_ADMIN)
    target = path.format(member=ops.members[Role.PLATFORM_ADMIN].pk, tenant=ops.tenant.pk)
    before = counts()
    for body in WEIRD_BODIES:
        raw = json.dumps(body).encode()
        response = client.call(method, target, raw=raw)
        assert 400 <= response.status < 500, (body, response.status, response.body)
        assert_openai_error(response, response.status)
    assert counts() == before


def test_invalid_utf8_is_a_client_error(alice: Org) -> None:
    response = alice.client(Role.TENANT_ADMIN).post("/api/v1/keys", raw=b'{"name": "\xff\xfe"}')
    assert 400 <= response.status < 500
    assert_openai_error(response, response.status)


def test_unknown_route_and_method_are_json_errors(alice: Org) -> None:
    client = alice.client(Role.TENANT_ADMIN)
    assert_openai_error(client.get("/api/v1/does-not-exist"), 404)
    assert_openai_error(client.get("/totally/elsewhere"), 404)
    response = client.call("PUT", "/api/v1/keys", {"name": "x"})
    assert 400 <= response.status < 500
    assert_openai_error(response, response.status)
