"""Hosted tools (tools the API's provider would run: OpenAI's `web_search`, Anthropic's
server tools) under each tenant's policy, and Codex CLI's `client_metadata`, against a
live server through the official openai and anthropic SDKs: `drop` (the default) leaves
the tool out, names it in `x-sluice-dropped-tools` and the audit event; `refuse` is a
400 naming it; a tenant admin sets the policy through the management API (another
tenant's admin cannot: NotFound, as a missing tenant), audited."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from governance import audit
from governance.models import AuditEvent
from streaming.apis.responses import writer as responses_writer
from streaming.models import StoredResponse
from tenants.models import Tenant
from tenants.roles import Role
from tests.conftest import ApiClient, Org, eventually, make_org, signed_in
from tests.streaming.conftest import Live
from tests.streaming.test_anthropic import WEATHER, hello
from tests.streaming.test_anthropic import sdk as claude
from tests.streaming.test_responses import sdk

pytestmark = pytest.mark.slow

HEADER = "x-sluice-dropped-tools"
SHELL: Any = {"type": "function", "name": "shell", "description": "Runs a command",
              "strict": False, "parameters": {
                  "type": "object", "properties": {"command": {"type": "string"}},
                  "required": ["command"], "additionalProperties": False}}
# Codex CLI's tool list, in the shape it sends: function tools and a hosted web search.
CODEX_TOOLS: Any = [SHELL, {"type": "web_search", "external_web_access": False}]
TURN_METADATA = json.dumps({"turn_id": "t" * 712, "sandbox": "read-only"})  # 751 long


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("alice", [Role.TENANT_ADMIN, Role.DEVELOPER])


@pytest.fixture
def client(live: Live, org: Org) -> openai.OpenAI:
    return sdk(live, org.keys[Role.DEVELOPER])


def set_policy(org: Org, value: str) -> None:
    response = org.client(Role.TENANT_ADMIN).patch(
        f"/api/v1/tenants/{org.tenant.pk}/tool-policy", {"hosted_tools": value})
    assert response.status == 200 and response.body["hosted_tools"] == value, response


def events(org: Org, action: str) -> list[AuditEvent]:
    audit.drain(settle_s=0.1)
    return list(AuditEvent.objects.filter(tenant=org.tenant, action=action).order_by("id"))


# -- drop (the default) --------------------------------------------------------------------
def test_codexs_tool_list_passes_with_web_search_dropped_named_and_audited(
        client: openai.OpenAI, org: Org, roomy: str) -> None:
    # Given the default policy and a model that can call tools; When Codex's tool list
    # comes with a request
    raw = client.responses.with_raw_response.create(
        model=roomy, input="hello", tools=CODEX_TOOLS, store=False, max_output_tokens=8)
    # Then the call is served without the hosted tool, which the header names
    assert raw.headers[HEADER] == "web_search"
    response = raw.parse()
    assert response.status in ("completed", "incomplete")
    assert [t.type for t in response.tools] == ["function"]
    # and its audit event records what was dropped
    [event] = eventually(lambda: events(org, "responses"), what="the call's audit event")
    assert event.status == 200 and event.detail["dropped_tools"] == "web_search"


def test_a_stream_names_the_dropped_tools_once_each_in_order(client: openai.OpenAI,
                                                              roomy: str) -> None:
    tools: Any = [{"type": "code_interpreter", "container": {"type": "auto"}}, SHELL,
                  {"type": "web_search_2025_08_26"}, {"type": "code_interpreter"},
                  {"type": "some_future_tool"}]
    with client.responses.with_streaming_response.create(
            model=roomy, input="hi", tools=tools, stream=True, store=False,
            max_output_tokens=8) as raw:
        assert raw.headers[HEADER] == "code_interpreter,web_search_2025_08_26,some_future_tool"
        kinds = [json.loads(line[6:])["type"] for line in raw.iter_lines()
                 if line.startswith("data: ")]
    assert kinds[-1] in ("response.completed", "response.incomplete")


def test_a_call_without_hosted_tools_has_no_header(client: openai.OpenAI,
                                                   roomy: str) -> None:
    raw = client.responses.with_raw_response.create(model=roomy, input="hi", tools=[SHELL],
                                                    store=False, max_output_tokens=8)
    assert HEADER not in raw.headers


def test_a_malformed_function_tool_beside_a_dropped_one_is_named_by_its_own_index(
        client: openai.OpenAI) -> None:
    # A known type stays the schema's to check: a function without a name is a 400
    tools: Any = [{"type": "web_search"}, {"type": "function"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="echo", input="hi", tools=tools)
    assert caught.value.param == "tools[1].name"


# -- refuse, set by the tenant's admin -------------------------------------------------------
def test_refuse_is_a_400_naming_the_tool_and_the_change_is_audited(
        client: openai.OpenAI, org: Org, roomy: str) -> None:
    # Given the tenant's admin sets `refuse` through the management API
    set_policy(org, "refuse")
    # When Codex's tool list comes; Then a 400 names the hosted tool
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=roomy, input="hi", tools=CODEX_TOOLS)
    assert caught.value.param == "tools[1].type"
    assert "'web_search'" in caught.value.message
    # and the change is in the audit log, with who made it and the values
    [change] = eventually(lambda: events(org, "tenant.tool_policy"), what="the change")
    assert change.actor == org.members[Role.TENANT_ADMIN].subject
    assert change.detail == {"hosted_tools": "refuse", "was_hosted_tools": "drop"}
    # and `drop` again serves the call
    set_policy(org, "drop")
    assert client.responses.create(model=roomy, input="hi", tools=CODEX_TOOLS, store=False,
                                   max_output_tokens=8).status in ("completed", "incomplete")


def test_another_tenants_admin_cannot_see_or_change_the_policy(live: Live, org: Org) -> None:
    bob = make_org("bob", [Role.TENANT_ADMIN])
    admin: ApiClient = bob.client(Role.TENANT_ADMIN)
    missing = max(Tenant.objects.values_list("pk", flat=True)) + 1000
    for method, body in (("GET", None), ("PATCH", {"hosted_tools": "refuse"})):
        theirs = admin.call(method, f"/api/v1/tenants/{org.tenant.pk}/tool-policy", body)
        nobody = admin.call(method, f"/api/v1/tenants/{missing}/tool-policy", body)
        assert theirs.status == nobody.status == 404
        assert theirs.body == nobody.body
    org.tenant.refresh_from_db()
    assert org.tenant.hosted_tools == "drop"
    assert not events(org, "tenant.tool_policy")
    # while alice's developer may read it but not change it
    dev = org.client(Role.DEVELOPER)
    assert dev.get(f"/api/v1/tenants/{org.tenant.pk}/tool-policy").body["hosted_tools"] == "drop"
    assert dev.patch(f"/api/v1/tenants/{org.tenant.pk}/tool-policy",
                     {"hosted_tools": "refuse"}).status == 403


# -- Anthropic's server tools ---------------------------------------------------------------
def test_anthropic_server_tools_are_dropped_or_refused(live: Live, org: Org,
                                                       roomy: str) -> None:
    client = claude(live, org.keys[Role.DEVELOPER])
    tools: Any = [WEATHER, {"type": "web_search_20250305", "name": "web_search",
                            "max_uses": 3},
                  {"type": "bash_20250124", "name": "bash"}]
    raw = client.messages.with_raw_response.create(
        model=roomy, max_tokens=8, messages=hello("hi"), tools=tools)
    assert raw.headers[HEADER] == "web_search_20250305,bash_20250124"
    assert raw.parse().stop_reason in ("end_turn", "max_tokens", "tool_use")
    set_policy(org, "refuse")
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=roomy, max_tokens=8, messages=hello("hi"),
                               tools=tools)
    error = caught.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("tools.1.type: 'web_search_20250305'")


# -- client_metadata ----------------------------------------------------------------------
def test_codexs_client_metadata_passes_and_is_kept_nowhere(
        client: openai.OpenAI, org: Org) -> None:
    # Given Codex's turn metadata, 751 characters, on a stored response
    assert len(TURN_METADATA) == 751
    response = client.responses.create(
        model="echo", input="hi", extra_body={"client_metadata": {
            "x-codex-turn-metadata": TURN_METADATA, "x-codex-installation-id": "i-1"}})
    assert response.output_text == "hi"
    # Then neither the stored response nor the audit event holds it
    responses_writer.drain()
    stored = json.dumps(list(StoredResponse.objects.filter(public_id=response.id).values()),
                        default=str)
    assert response.id in stored and "x-codex" not in stored and "t" * 100 not in stored
    [event] = eventually(lambda: events(org, "responses"), what="the call's audit event")
    recorded = json.dumps(AuditEvent.objects.filter(pk=event.pk).values().get(), default=str)
    assert "x-codex" not in recorded and "t" * 100 not in recorded


@pytest.mark.parametrize(("metadata", "param"), [
    ({"x-codex-turn-metadata": "x" * 4097}, "client_metadata.x-codex-turn-metadata"),
    ({f"k{i}": "v" for i in range(17)}, "client_metadata"),
    ({"k" * 65: "v"}, "client_metadata"),
])
def test_client_metadata_over_a_bound_is_a_400_naming_it(
        client: openai.OpenAI, metadata: dict[str, str], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="echo", input="hi", store=False,
                                extra_body={"client_metadata": metadata})
    assert str(caught.value.param).startswith(param), caught.value.param
    assert "x" * 100 not in caught.value.message  # the value is not echoed


# -- the admin UI ---------------------------------------------------------------------------
def test_a_tenant_admin_sets_the_policy_in_the_ui(alice: Org) -> None:
    page = signed_in(alice, Role.TENANT_ADMIN)
    assert b"Hosted tools" in page.get("/ui/tool-policy").content
    saved = page.post("/ui/tool-policy", {"hosted_tools": "refuse"})
    assert saved.status_code == 302
    alice.tenant.refresh_from_db()
    assert alice.tenant.hosted_tools == "refuse"
    # a developer may not open the form
    assert signed_in(alice, Role.DEVELOPER).get("/ui/tool-policy").status_code == 403
