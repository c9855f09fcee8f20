"""The Responses API's edges over the official openai client against a live server:
every error in OpenAI's shape, who may read a stored response (another tenant's or
member's is a 404), personal data redacted in storage and retention."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import httpx
import openai
import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from governance import privacy
from governance.models import Quota, RateLimitPolicy
from streaming.apis.responses import writer as responses_writer
from streaming.apis.responses.store import response_create, response_get, responses_purge
from streaming.models import StoredResponse
from tenants.models import Member, Tenant
from tenants.roles import Role
from tenants.services import apikey_create
from tests.conftest import PASSWORD, Org, make_org, principal_for
from tests.streaming.conftest import Live, assert_quota_exhausted, assert_rate_limited
from tests.streaming.test_responses import ORDER, sdk

pytestmark = pytest.mark.slow


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("alice", [Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR])


@pytest.fixture
def client(live: Live, org: Org) -> openai.OpenAI:
    return sdk(live, org.keys[Role.DEVELOPER])


# -- errors, in OpenAI's shape --------------------------------------------------------------
def test_a_bad_key_is_a_401(live: Live, org: Org) -> None:
    key = org.keys[Role.DEVELOPER]
    wrong = key[:-4] + ("aaaa" if not key.endswith("aaaa") else "bbbb")
    with pytest.raises(openai.AuthenticationError) as caught:
        sdk(live, wrong).responses.create(model="echo", input="hi")
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_an_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="no-such-model", input="hi")
    assert caught.value.code == "model_not_found" and caught.value.param == "model"


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "hi", "max_output_tokens": 10_000}, "max_output_tokens",
     "max_tokens_too_large"),
    ({"input": "hi", "frequency_penalty": 1}, "frequency_penalty", "unknown_parameter"),
    ({}, "input", "missing_required_parameter"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type",
     "unsupported_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "unsupported_value"),
    ({"input": [{"type": "function_call_output", "output": "18"}]}, "input[0].call_id",
     "missing_required_parameter"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name",
     "missing_required_parameter"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "strict": True,
                                "parameters": {"type": "object",
                                               "properties": {"x": {"type": "string"}}}}]},
     "tools[0].parameters", "invalid_function_parameters"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": ORDER}}},
     "text.format.name", "missing_required_parameter"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "object", "not": {}}}}},
     "text.format.schema", "invalid_response_format"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", None),
    ({"input": "hi", "previous_response_id": "resp_" + "0" * 24}, "previous_response_id",
     "previous_response_not_found"),
])
def test_invalid_bodies_are_400s_naming_the_responses_field(
        live: Live, org: Org, body: dict[str, Any], param: str, code: str | None) -> None:
    response = httpx.post(f"{live.base_url}/responses", json={"model": "echo", **body},
                          headers={"Authorization": f"Bearer {org.keys[Role.DEVELOPER]}"},
                          timeout=30)
    error = response.json()["error"]
    assert response.status_code == (404 if code == "previous_response_not_found" else 400)
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert str(error["param"]).startswith(param), error
    if code is not None:
        assert error["code"] == code, error
    # the words are the Responses API's, not chat's
    assert not any(word in error["message"] for word in ("messages", "response_format",
                                                         "max_completion_tokens")), error


def test_rate_limited_is_a_429_with_the_headers_the_sdk_reads(client: openai.OpenAI,
                                                              org: Org) -> None:
    RateLimitPolicy.objects.create(scope="tenant", tenant=org.tenant, requests_per_minute=60,
                                   burst_requests=1)
    assert_rate_limited(client.responses, model="echo", input="hi")


def test_an_exhausted_quota_is_a_429_insufficient_quota(client: openai.OpenAI,
                                                        org: Org) -> None:
    Quota.objects.create(tenant=org.tenant, model="echo", period="minute", max_requests=1)
    assert_quota_exhausted(client.responses, model="echo", input="hi")


# -- who may read a stored response ---------------------------------------------------------
def colleague_key(org: Org) -> str:
    """The key of a second developer in `org`'s tenant."""
    user = get_user_model().objects.create_user(username=f"{org.tenant.slug}-dev2",
                                                password=PASSWORD)
    member = Member.objects.create(tenant=org.tenant, user=user, role=Role.DEVELOPER)
    return apikey_create(actor=principal_for(member), name="dev2", role=Role.DEVELOPER).secret


def test_another_tenants_or_members_response_is_a_404(live: Live, org: Org) -> None:
    # Given a developer's stored response
    mine = sdk(live, org.keys[Role.DEVELOPER]).responses.create(model="echo", input="mine")
    bob = make_org("bob", [Role.TENANT_ADMIN, Role.DEVELOPER])
    responses_writer.drain()
    before = list(StoredResponse.objects.order_by("pk").values())
    # When another tenant's admin or developer, or another developer of the same tenant,
    # names it: Then it is the missing-id 404 on every route, and nothing changed
    for key in (bob.keys[Role.TENANT_ADMIN], bob.keys[Role.DEVELOPER], colleague_key(org)):
        outsider = sdk(live, key)
        with pytest.raises(openai.NotFoundError):
            outsider.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            outsider.responses.input_items.list(mine.id)
        with pytest.raises(openai.NotFoundError):
            outsider.responses.delete(mine.id)
        with pytest.raises(openai.NotFoundError) as caught:
            outsider.responses.create(model="echo", input="x", previous_response_id=mine.id)
        assert caught.value.param == "previous_response_id"
    assert list(StoredResponse.objects.order_by("pk").values()) == before
    # An auditor may not read responses at all; the tenant's admin may read it
    with pytest.raises(openai.PermissionDeniedError):
        sdk(live, org.keys[Role.AUDITOR]).responses.retrieve(mine.id)
    admin = sdk(live, org.keys[Role.TENANT_ADMIN])
    assert admin.responses.retrieve(mine.id).output_text == "mine"


# -- personal data and retention -------------------------------------------------------------
SSN = "536-42-7151"


def test_personal_data_in_a_stored_response_is_redacted_in_the_database(
        client: openai.OpenAI) -> None:
    # Given the tenant's default policy (stored data redacted)
    # When a response whose input, output, instructions and metadata hold an SSN is made
    response = client.responses.create(
        model="echo", instructions=f"The caller's SSN is {SSN}.", metadata={"ssn": SSN},
        user="end-user\x00",
        input=[{"role": "user", "content": f"My SSN is {SSN}\x00."},
               {"type": "function_call", "call_id": "call_1", "name": "lookup",
                "arguments": json.dumps({"ssn": SSN, "n": 536427151})},
               {"type": "function_call_output", "call_id": "call_1", "output": f"ok {SSN}"},
               {"role": "user", "content": f"Repeat: {SSN}"}])
    # Then the caller got their own reply
    assert response.output_text == f"Repeat: {SSN}"
    # and the database keeps none of it raw (a NUL too is kept as U+FFFD)
    responses_writer.drain()
    row = StoredResponse.objects.values().get(public_id=response.id)
    stored = json.dumps(row, default=str)
    assert SSN not in stored and "[SSN]" in stored and "\\u0000" not in stored
    call = next(i for i in row["input_items"] if i["type"] == "function_call")
    assert json.loads(call["arguments"])["ssn"] == "[SSN]"  # still JSON
    # and reading it back shows the redacted text
    assert client.responses.retrieve(response.id).output_text == "Repeat: [SSN]"


def test_a_tenant_that_turned_redaction_off_keeps_its_text(client: openai.OpenAI,
                                                           org: Org) -> None:
    Tenant.objects.filter(pk=org.tenant.pk).update(redact_stored=False)
    privacy.clear()
    response = client.responses.create(model="echo", input=f"My SSN is {SSN}")
    responses_writer.drain()
    assert SSN in json.dumps(StoredResponse.objects.values().get(public_id=response.id),
                             default=str)


def test_responses_past_retention_are_gone_and_purged(org: Org) -> None:
    # Given two responses, one older than the tenant's retention (30 days by default)
    dev = principal_for(org.members[Role.DEVELOPER])

    def stored(rid: str) -> str:
        body = {"id": f"resp_{rid * 24}", "object": "response", "status": "completed",
                "model": "echo", "output": [], "usage": None, "created_at": 0}
        return response_create(actor=dev, body=body, input_items=[]).public_id

    old, new = stored("a"), stored("b")
    StoredResponse.objects.filter(public_id=old).update(
        created_at=timezone.now() - timedelta(days=31))
    StoredResponse.objects.filter(public_id=new).update(created_at=timezone.now())
    # Then the old one is NotFound at once, and the sweep deletes it alone
    with pytest.raises(Exception, match="No such response"):
        response_get(actor=dev, response_id=old)
    assert response_get(actor=dev, response_id=new).public_id == new
    assert responses_purge() == 1
    assert list(StoredResponse.objects.values_list("public_id", flat=True)) == [new]
