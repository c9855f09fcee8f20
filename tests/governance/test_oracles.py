"""Another tenant's objects are indistinguishable from missing ones. For every object
endpoint a tenant admin can reach, in the API and the UI (an id in the path, or an id
named in a body or a filter), alice's tenant admin asks once with an id of bob's and
once with an id that does not exist: the two answers are equal (status, body, where a
redirect goes) and nothing changed. A route with an id that has no row here fails
test_every_object_route_has_an_oracle_case."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db.models import Model
from django.forms.models import model_to_dict
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from governance import audit
from governance.guardrail_models import GuardrailPolicy
from governance.models import (
    AuditEvent,
    AuditExport,
    Budget,
    BudgetScope,
    Quota,
    RateLimitPolicy,
    RateLimitScope,
    RedactionPattern,
)
from streaming.apis.responses.store import response_create
from streaming.models import Batch, StoredFile, StoredResponse
from tenants.conversations import conversation_create
from tenants.models import ApiKey, Conversation, Member, Tenant
from tenants.roles import Role
from tests.conftest import Org, principal_for, signed_in

pytestmark = pytest.mark.django_db

TA = Role.TENANT_ADMIN


@dataclass(frozen=True)
class Ids:
    tenant: int
    member: int
    key: int
    limit: int
    quota: int
    budget: int
    guardrail: int
    export: int
    pattern: int
    event: int
    conversation: str
    file: str
    batch: str
    response: str


def bobs_objects(bob: Org) -> Ids:
    """One object of each kind in bob's tenant, made the way bob's people make them."""
    admin = principal_for(bob.members[TA])
    limit = RateLimitPolicy.objects.create(scope=RateLimitScope.API_KEY, tenant=bob.tenant,
                                           api_key=bob.key_rows[Role.DEVELOPER],
                                           requests_per_minute=5)
    audit.record_call(principal=admin, action="chat.completions", model="echo",
                      protocol="rest", status=200, latency_ms=1.0, request_text="hello")
    audit.drain()
    upload = Client().post(
        "/v1/files", {"purpose": "batch", "file": SimpleUploadedFile(
            "in.jsonl", b'{"custom_id": "1", "method": "POST", "url": '
                        b'"/v1/chat/completions", "body": {"model": "echo", "messages": '
                        b'[{"role": "user", "content": "hi"}]}}\n')},
        HTTP_AUTHORIZATION=f"Bearer {bob.keys[TA]}")
    assert upload.status_code == 200, upload.content
    file_id = upload.json()["id"]
    batch = bob.client(TA).post("/v1/batches", {"input_file_id": file_id,
                                                "endpoint": "/v1/chat/completions"})
    assert batch.status == 200, batch.body
    return Ids(
        tenant=bob.tenant.pk, member=bob.members[Role.DEVELOPER].pk,
        key=bob.key_rows[Role.DEVELOPER].pk, limit=limit.pk,
        quota=Quota.objects.create(tenant=bob.tenant, max_requests=5).pk,
        budget=Budget.objects.create(tenant=bob.tenant, scope=BudgetScope.MEMBER,
                                     member=bob.members[Role.DEVELOPER], limit_usd=1).pk,
        guardrail=GuardrailPolicy.objects.create(
            tenant=bob.tenant, name="bob's", guard="pii", phase="pre", action="mask",
            scope="tenant").pk,
        export=AuditExport.objects.create(tenant=bob.tenant, requested_by=admin.subject,
                                          format="csv").pk,
        pattern=RedactionPattern.objects.create(tenant=bob.tenant, label="X",
                                                pattern="x-\\d+").pk,
        event=AuditEvent.objects.filter(tenant_id=bob.tenant.pk).latest("id").pk,
        conversation=conversation_create(actor=admin, title="bob's").public_id,
        file=file_id, batch=batch.body["id"],
        response=response_create(actor=admin, input_items=[], body={
            "id": f"resp_{'b' * 24}", "object": "response", "status": "completed",
            "model": "echo", "output": [], "usage": None}).public_id)


def missing_ids(theirs: Ids) -> Ids:
    """Ids of the same shape that nothing has."""
    big = 10**9
    return Ids(tenant=big + 1, member=big + 2, key=big + 3, limit=big + 4, quota=big + 5,
               budget=big + 9, guardrail=big + 10, export=big + 6, pattern=big + 7, event=big + 8,
               conversation=f"conv_{'0' * 24}", file=f"file-{'0' * 24}",
               batch=f"batch_{'0' * 24}", response=f"resp_{'0' * 24}")


SNAPSHOT: list[tuple[type[Model], list[str]]] = [
    (Tenant, []), (Member, []), (ApiKey, ["last_used_at"]), (Conversation, []),
    (RateLimitPolicy, []), (Quota, []), (Budget, []), (GuardrailPolicy, []), (AuditExport, []),
    (RedactionPattern, []),
    (StoredFile, []), (Batch, []), (StoredResponse, []),
]


def snapshot() -> dict[str, list[dict[str, Any]]]:
    return {model.__name__: [model_to_dict(row, exclude=skip)
                             for row in model._default_manager.order_by("pk")]
            for model, skip in SNAPSHOT}


LIMIT_FORM = {"requests_per_minute": "1", "qps_ref": "1000", "qps_min": "0.5",
              "qps_max": "2", "p99_target_ms": "200", "p99_slope": "0.01", "floor": "0.3",
              "window_s": "60"}
NEW_KEY_LIMIT = {"scope": "api_key", "requests_per_minute": 30}


@dataclass(frozen=True)
class Case:
    surface: str  # "api" (alice's tenant admin's API key) or "ui" (their session)
    method: str
    route: str  # the URL pattern, for the coverage check
    path: Callable[[Ids], str]
    body: Callable[[Ids], Any] | None = None


CASES: dict[str, Case] = {
    # -- management API: tenants ---------------------------------------------------------
    "tenant get": Case("api", "GET", "api/v1/tenants/<int:tenant_id>",
                       lambda i: f"/api/v1/tenants/{i.tenant}"),
    "tenant update": Case("api", "PATCH", "api/v1/tenants/<int:tenant_id>",
                          lambda i: f"/api/v1/tenants/{i.tenant}", lambda i: {"name": "x"}),
    "billing get": Case("api", "GET", "api/v1/tenants/<int:tenant_id>/billing",
                        lambda i: f"/api/v1/tenants/{i.tenant}/billing"),
    "billing update": Case("api", "PATCH", "api/v1/tenants/<int:tenant_id>/billing",
                           lambda i: f"/api/v1/tenants/{i.tenant}/billing",
                           lambda i: {"time_zone": "UTC"}),
    "privacy get": Case("api", "GET", "api/v1/tenants/<int:tenant_id>/privacy",
                        lambda i: f"/api/v1/tenants/{i.tenant}/privacy"),
    "privacy update": Case("api", "PATCH", "api/v1/tenants/<int:tenant_id>/privacy",
                           lambda i: f"/api/v1/tenants/{i.tenant}/privacy",
                           lambda i: {"redact_stored": False}),
    "tool policy get": Case("api", "GET", "api/v1/tenants/<int:tenant_id>/tool-policy",
                            lambda i: f"/api/v1/tenants/{i.tenant}/tool-policy"),
    "tool policy update": Case("api", "PATCH", "api/v1/tenants/<int:tenant_id>/tool-policy",
                               lambda i: f"/api/v1/tenants/{i.tenant}/tool-policy",
                               lambda i: {"hosted_tools": "refuse"}),
    "ui tool policy page": Case("ui", "GET", "ui/tenants/<int:tenant_id>/tool-policy",
                                lambda i: f"/ui/tenants/{i.tenant}/tool-policy"),
    "ui tool policy save": Case("ui", "POST", "ui/tenants/<int:tenant_id>/tool-policy",
                                lambda i: f"/ui/tenants/{i.tenant}/tool-policy",
                                lambda i: {"hosted_tools": "refuse"}),
    "member get": Case("api", "GET", "api/v1/members/<int:member_id>",
                       lambda i: f"/api/v1/members/{i.member}"),
    "member update": Case("api", "PATCH", "api/v1/members/<int:member_id>",
                          lambda i: f"/api/v1/members/{i.member}",
                          lambda i: {"role": "auditor"}),
    "member delete": Case("api", "DELETE", "api/v1/members/<int:member_id>",
                          lambda i: f"/api/v1/members/{i.member}"),
    "key get": Case("api", "GET", "api/v1/keys/<int:key_id>",
                    lambda i: f"/api/v1/keys/{i.key}"),
    "key revoke": Case("api", "DELETE", "api/v1/keys/<int:key_id>",
                       lambda i: f"/api/v1/keys/{i.key}"),
    "conversation get": Case("api", "GET", "api/v1/conversations/<conversation_id>",
                             lambda i: f"/api/v1/conversations/{i.conversation}"),
    "conversation delete": Case("api", "DELETE", "api/v1/conversations/<conversation_id>",
                                lambda i: f"/api/v1/conversations/{i.conversation}"),
    # -- management API: governance ------------------------------------------------------
    "limit get": Case("api", "GET", "api/v1/governance/rate-limits/<int:policy_id>",
                      lambda i: f"/api/v1/governance/rate-limits/{i.limit}"),
    "limit update": Case("api", "PATCH", "api/v1/governance/rate-limits/<int:policy_id>",
                         lambda i: f"/api/v1/governance/rate-limits/{i.limit}",
                         lambda i: {"requests_per_minute": 100_000}),
    "limit delete": Case("api", "DELETE", "api/v1/governance/rate-limits/<int:policy_id>",
                         lambda i: f"/api/v1/governance/rate-limits/{i.limit}"),
    "limit create, tenant": Case("api", "POST", "api/v1/governance/rate-limits",
                                 lambda i: "/api/v1/governance/rate-limits",
                                 lambda i: {**NEW_KEY_LIMIT, "tenant_id": i.tenant}),
    "limit create, key": Case("api", "POST", "api/v1/governance/rate-limits",
                              lambda i: "/api/v1/governance/rate-limits",
                              lambda i: {**NEW_KEY_LIMIT, "api_key_id": i.key}),
    "limit create, tenant and key": Case(
        "api", "POST", "api/v1/governance/rate-limits",
        lambda i: "/api/v1/governance/rate-limits",
        lambda i: {**NEW_KEY_LIMIT, "tenant_id": i.tenant, "api_key_id": i.key}),
    "limit list": Case("api", "GET", "api/v1/governance/rate-limits",
                       lambda i: f"/api/v1/governance/rate-limits?tenant_id={i.tenant}"),
    "quota get": Case("api", "GET", "api/v1/governance/quotas/<int:quota_id>",
                      lambda i: f"/api/v1/governance/quotas/{i.quota}"),
    "quota update": Case("api", "PATCH", "api/v1/governance/quotas/<int:quota_id>",
                         lambda i: f"/api/v1/governance/quotas/{i.quota}",
                         lambda i: {"max_requests": 100_000}),
    "quota delete": Case("api", "DELETE", "api/v1/governance/quotas/<int:quota_id>",
                         lambda i: f"/api/v1/governance/quotas/{i.quota}"),
    "quota create": Case("api", "POST", "api/v1/governance/quotas",
                         lambda i: "/api/v1/governance/quotas",
                         lambda i: {"tenant_id": i.tenant, "max_tokens": 5}),
    "quota list": Case("api", "GET", "api/v1/governance/quotas",
                       lambda i: f"/api/v1/governance/quotas?tenant_id={i.tenant}"),
    "budget get": Case("api", "GET", "api/v1/governance/budgets/<int:budget_id>",
                       lambda i: f"/api/v1/governance/budgets/{i.budget}"),
    "budget update": Case("api", "PATCH", "api/v1/governance/budgets/<int:budget_id>",
                          lambda i: f"/api/v1/governance/budgets/{i.budget}",
                          lambda i: {"limit_usd": 2}),
    "budget delete": Case("api", "DELETE", "api/v1/governance/budgets/<int:budget_id>",
                          lambda i: f"/api/v1/governance/budgets/{i.budget}"),
    "guardrail get": Case("api", "GET", "api/v1/governance/guardrails/<int:policy_id>",
                          lambda i: f"/api/v1/governance/guardrails/{i.guardrail}"),
    "guardrail update": Case("api", "PATCH", "api/v1/governance/guardrails/<int:policy_id>",
                             lambda i: f"/api/v1/governance/guardrails/{i.guardrail}",
                             lambda i: {"shadow": True}),
    "guardrail delete": Case("api", "DELETE", "api/v1/governance/guardrails/<int:policy_id>",
                             lambda i: f"/api/v1/governance/guardrails/{i.guardrail}"),
    "guardrail on their key": Case("api", "POST", "api/v1/governance/guardrails",
                                   lambda i: "/api/v1/governance/guardrails",
                                   lambda i: {"name": "k", "guard": "pii", "phase": "pre",
                                              "action": "mask", "scope": "key",
                                              "key_id": i.key}),
    "budget for a member": Case("api", "POST", "api/v1/governance/budgets",
                                lambda i: "/api/v1/governance/budgets",
                                lambda i: {"scope": "member", "member_id": i.member,
                                           "limit_usd": 1}),
    "budget for a key": Case("api", "POST", "api/v1/governance/budgets",
                             lambda i: "/api/v1/governance/budgets",
                             lambda i: {"scope": "key", "key_id": i.key, "limit_usd": 1}),
    "budget list": Case("api", "GET", "api/v1/governance/budgets",
                        lambda i: f"/api/v1/governance/budgets?tenant_id={i.tenant}"),
    "usage list": Case("api", "GET", "api/v1/governance/usage",
                       lambda i: f"/api/v1/governance/usage?tenant_id={i.tenant}"),
    "pattern delete": Case("api", "DELETE",
                           "api/v1/governance/redaction-patterns/<int:pattern_id>",
                           lambda i: f"/api/v1/governance/redaction-patterns/{i.pattern}"),
    "audit events": Case("api", "GET", "api/v1/audit/events",
                         lambda i: f"/api/v1/audit/events?tenant_id={i.tenant}"),
    "export create": Case("api", "POST", "api/v1/audit/exports",
                          lambda i: "/api/v1/audit/exports",
                          lambda i: {"format": "csv", "tenant_id": i.tenant}),
    "export get": Case("api", "GET", "api/v1/audit/exports/<int:export_id>",
                       lambda i: f"/api/v1/audit/exports/{i.export}"),
    "export download": Case("api", "GET", "api/v1/audit/exports/<int:export_id>/download",
                            lambda i: f"/api/v1/audit/exports/{i.export}/download"),
    # -- OpenAI's files and batches ---------------------------------------------------------
    "file get": Case("api", "GET", "v1/files/<file_id>", lambda i: f"/v1/files/{i.file}"),
    "file delete": Case("api", "DELETE", "v1/files/<file_id>",
                        lambda i: f"/v1/files/{i.file}"),
    "file content": Case("api", "GET", "v1/files/<file_id>/content",
                         lambda i: f"/v1/files/{i.file}/content"),
    "batch create": Case("api", "POST", "v1/batches", lambda i: "/v1/batches",
                         lambda i: {"input_file_id": i.file,
                                    "endpoint": "/v1/chat/completions"}),
    "batch get": Case("api", "GET", "v1/batches/<batch_id>",
                      lambda i: f"/v1/batches/{i.batch}"),
    "batch cancel": Case("api", "POST", "v1/batches/<batch_id>/cancel",
                         lambda i: f"/v1/batches/{i.batch}/cancel"),
    # -- OpenAI's stored responses --------------------------------------------------------------
    "response get": Case("api", "GET", "v1/responses/<response_id>",
                         lambda i: f"/v1/responses/{i.response}"),
    "response delete": Case("api", "DELETE", "v1/responses/<response_id>",
                            lambda i: f"/v1/responses/{i.response}"),
    "response input items": Case("api", "GET", "v1/responses/<response_id>/input_items",
                                 lambda i: f"/v1/responses/{i.response}/input_items"),
    # -- the admin UI -------------------------------------------------------------------------
    "ui guardrail edit page": Case("ui", "GET", "ui/guardrails/<int:policy_id>",
                                   lambda i: f"/ui/guardrails/{i.guardrail}"),
    "ui guardrail save": Case("ui", "POST", "ui/guardrails/<int:policy_id>",
                              lambda i: f"/ui/guardrails/{i.guardrail}",
                              lambda i: {"name": "x", "action": "flag", "timeout_ms": "5",
                                         "on_error": "open"}),
    "ui guardrail delete": Case("ui", "POST", "ui/guardrails/<int:policy_id>",
                                lambda i: f"/ui/guardrails/{i.guardrail}",
                                lambda i: {"delete": "1"}),
    "ui budget edit page": Case("ui", "GET", "ui/budgets/<int:budget_id>",
                                lambda i: f"/ui/budgets/{i.budget}"),
    "ui budget save": Case("ui", "POST", "ui/budgets/<int:budget_id>",
                           lambda i: f"/ui/budgets/{i.budget}",
                           lambda i: {"limit_usd": "1", "alert_at": "50"}),
    "ui budget delete": Case("ui", "POST", "ui/budgets/<int:budget_id>",
                             lambda i: f"/ui/budgets/{i.budget}", lambda i: {"delete": "1"}),
    "ui limit edit page": Case("ui", "GET", "ui/limits/<int:policy_id>",
                               lambda i: f"/ui/limits/{i.limit}"),
    "ui limit save": Case("ui", "POST", "ui/limits/<int:policy_id>",
                          lambda i: f"/ui/limits/{i.limit}", lambda i: LIMIT_FORM),
    "ui limit delete": Case("ui", "POST", "ui/limits/<int:policy_id>",
                            lambda i: f"/ui/limits/{i.limit}", lambda i: {"delete": "1"}),
    "ui new limit on a key": Case(
        "ui", "POST", "ui/limits/new", lambda i: "/ui/limits/new",
        lambda i: {**LIMIT_FORM, "scope": "api_key", "api_key_id": str(i.key)}),
    "ui new limit for a tenant": Case(
        "ui", "POST", "ui/limits/new", lambda i: "/ui/limits/new",
        lambda i: {**LIMIT_FORM, "scope": "api_key", "tenant": str(i.tenant),
                   "api_key_id": str(i.key)}),
    "ui quota edit page": Case("ui", "GET", "ui/quotas/<int:quota_id>",
                               lambda i: f"/ui/quotas/{i.quota}"),
    "ui quota delete": Case("ui", "POST", "ui/quotas/<int:quota_id>",
                            lambda i: f"/ui/quotas/{i.quota}", lambda i: {"delete": "1"}),
    "ui member page": Case("ui", "GET", "ui/members/<int:member_id>",
                           lambda i: f"/ui/members/{i.member}"),
    "ui member save": Case("ui", "POST", "ui/members/<int:member_id>",
                           lambda i: f"/ui/members/{i.member}",
                           lambda i: {"role": "auditor", "is_active": "on"}),
    "ui key revoke": Case("ui", "POST", "ui/keys/<int:key_id>/revoke",
                          lambda i: f"/ui/keys/{i.key}/revoke", lambda i: {}),
    "ui audit event": Case("ui", "GET", "ui/audit/<int:event_id>",
                           lambda i: f"/ui/audit/{i.event}"),
    "ui export page": Case("ui", "GET", "ui/audit/exports/<int:export_id>",
                           lambda i: f"/ui/audit/exports/{i.export}"),
    "ui export status": Case("ui", "GET", "ui/audit/exports/<int:export_id>",
                             lambda i: f"/ui/audit/exports/{i.export}?format=json"),
    "ui export download": Case("ui", "GET", "ui/audit/exports/<int:export_id>/download",
                               lambda i: f"/ui/audit/exports/{i.export}/download"),
}

# Routes with an id that names no tenant's object: deployments (upstreams among them),
# model aliases, breakers and models are platform-wide (and their writes platform
# admins' alone); static files are the UI's.
NOT_TENANT_OBJECTS = {
    "ui/deployments/<str:name>", "ui/deployments/<str:name>/breaker",
    "ui/upstreams/<str:name>", "ui/aliases/<path:name>/edit",
    "api/v1/model-aliases/<path:name>",
    "ui/static/<str:name>", "api/v1/deployments/<name>", "api/v1/deployments/<name>/scaling",
    "api/v1/governance/breakers/<name>", "api/v1/governance/breakers/<name>/reset",
    "v1/models/<path:model>",
    "api/v1/governance/prices/<int:price_id>",  # platform-wide, readable by every role
}

CSRF = re.compile(r'name="csrfmiddlewaretoken" value="[^"]*"')
# A refused form shows what was typed back in its field: the id itself.
TYPED_ID = re.compile(r'(name="api_key_id" value=")\d+"')


@dataclass
class Answer:
    status: int
    body: str
    location: str


def ask(client: Client, case: Case, ids: Ids, token: str | None) -> Answer:
    path, body = case.path(ids), case.body(ids) if case.body else None
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    if case.surface == "api":
        kwargs: dict[str, Any] = {"data": body, "content_type": "application/json"} \
            if body is not None else {}
        response = getattr(client, case.method.lower())(path, **kwargs, **headers)
    else:
        response = getattr(client, case.method.lower())(path, body or {})
    text = b"".join(response.streaming_content).decode() if response.streaming \
        else response.content.decode()
    # The answers may name the id that was asked for (a public id in a message): that
    # is the caller's own input, not a fact about the object.
    for own in {str(v) for v in (ids.conversation, ids.file, ids.batch, ids.response)}:
        text = text.replace(own, "<id>")
    text = TYPED_ID.sub(r'\1<id>"', CSRF.sub("csrf", text))
    return Answer(response.status_code, text, response.get("Location", ""))



@pytest.fixture(autouse=True)
def _state_dir(settings: Any, tmp_path: Path) -> None:
    settings.STATE_DIR = tmp_path  # uploaded files and exports land in the test's folder


@pytest.mark.parametrize("name", list(CASES))
def test_another_tenants_object_answers_like_a_missing_one(alice: Org, bob: Org,
                                                           name: str) -> None:
    # Given one object of each kind in bob's tenant, and ids that nothing has
    case = CASES[name]
    theirs = bobs_objects(bob)
    missing = missing_ids(theirs)
    client = Client() if case.surface == "api" else signed_in(alice, TA)
    token = alice.keys[TA] if case.surface == "api" else None
    before = snapshot()
    # When alice's tenant admin asks with each
    other = ask(client, case, theirs, token)
    absent = ask(client, case, missing, token)
    # Then the answers are the same, and nothing changed
    assert (other.status, other.location) == (absent.status, absent.location), \
        (other, absent)
    assert other.body == absent.body
    assert snapshot() == before


def _routes(patterns: list[URLPattern | URLResolver], prefix: str = "") -> set[str]:
    found: set[str] = set()
    for pattern in patterns:
        route = prefix + str(pattern.pattern)
        if isinstance(pattern, URLResolver):
            found |= _routes(pattern.url_patterns, route)
        else:
            found.add(route)
    return found


def test_every_object_route_has_an_oracle_case() -> None:
    with_ids = {r for r in _routes(get_resolver().url_patterns) if "<" in r}
    covered = {case.route for case in CASES.values()}
    assert with_ids - NOT_TENANT_OBJECTS <= covered, with_ids - NOT_TENANT_OBJECTS - covered


def test_a_tenant_admins_forms_offer_no_other_tenant(ops: Org, alice: Org, bob: Org) -> None:
    # Given three tenants, When alice's tenant admin opens the new limit form
    page = signed_in(alice, TA).get("/ui/limits/new")
    # Then no other tenant is named or offered (their limits are on their own keys)
    html = page.content.decode()
    assert page.status_code == 200
    for other in (bob, ops):
        assert other.tenant.slug not in html and other.tenant.name not in html
        assert f'value="{other.tenant.pk}"' not in html
    # while a platform admin picks among every tenant, in the limit and quota forms
    admin = signed_in(ops, Role.PLATFORM_ADMIN)
    for url in ("/ui/limits/new", "/ui/quotas/new"):
        offered = admin.get(url).content.decode()
        assert all(f'value="{o.tenant.pk}"' in offered for o in (alice, bob, ops)), url
