"""Role x endpoint matrix for every management endpoint.

Each cell is the status a role gets on its *own* tenant's objects; cross-tenant access is
in test_cross_tenant.py. One table, so a new endpoint without a row fails
test_matrix_covers_every_route."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from secrets import token_hex
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.urls import get_resolver

from governance.guardrail_models import GuardrailPolicy
from governance.models import (
    AuditExport,
    Budget,
    Price,
    Quota,
    RateLimitPolicy,
    RedactionPattern,
)
from inference.models import AliasTarget, Deployment, ModelAlias
from streaming.apis.responses.store import response_create
from tenants.conversations import conversation_create
from tenants.models import Member
from tenants.roles import Role
from tenants.services import apikey_create
from tests.conftest import PASSWORD, ApiClient, Org, assert_openai_error, principal_for

pytestmark = pytest.mark.django_db

PA, TA, DEV, AUD = Role.PLATFORM_ADMIN, Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR


@dataclass
class Ctx:
    org: Org
    role: Role

    @property
    def member(self) -> Member:
        return self.org.members[self.role]

    def fresh_member(self) -> Member:
        n = Member.objects.count()
        user = get_user_model().objects.create_user(username=f"target-{n}", password=PASSWORD)
        return Member.objects.create(tenant=self.org.tenant, user=user, role=DEV)

    def deployment(self) -> str:
        Deployment.objects.get_or_create(name="echo-matrix", defaults={"runtime": "echo"})
        return "echo-matrix"

    def alias(self) -> str:
        """A model alias over the matrix's deployment (made as a platform admin would)."""
        alias, _ = ModelAlias.objects.get_or_create(name="alias-matrix")
        AliasTarget.objects.get_or_create(alias=alias, deployment_id=Deployment.objects.get(
            name=self.deployment()).pk)
        return alias.name

    def fresh_conversation(self) -> str:
        return conversation_create(actor=principal_for(self.member)).public_id

    def fresh_response(self) -> str:
        """A stored response of the member's (the Responses API's)."""
        body = {"id": f"resp_{token_hex(12)}", "object": "response", "status": "completed",
                "model": "echo", "output": [], "usage": None}
        return response_create(actor=principal_for(self.member), body=body,
                               input_items=[]).public_id

    def fresh_key_id(self) -> int:
        return apikey_create(actor=principal_for(self.member), name="target").key.pk

    def fresh_limit(self) -> int:
        return RateLimitPolicy.objects.create(scope="api_key", tenant=self.org.tenant,
                                              requests_per_minute=10).pk

    def fresh_pattern(self) -> int:
        return RedactionPattern.objects.create(tenant=self.org.tenant, label="X",
                                               pattern="x-\\d+").pk

    def fresh_export(self) -> int:
        return AuditExport.objects.create(tenant=self.org.tenant, requested_by="t",
                                          format="jsonl").pk

    def fresh_quota(self) -> int:
        return Quota.objects.create(tenant=self.org.tenant, max_requests=10).pk

    def fresh_price(self) -> int:
        return Price.objects.create(model=f"m-{token_hex(4)}", input_per_mtok_usd=1,
                                    output_per_mtok_usd=2).pk

    def fresh_guard(self) -> int:
        return GuardrailPolicy.objects.create(tenant=self.org.tenant, name="g", guard="pii",
                                              phase="pre", action="mask", scope="tenant").pk

    def fresh_budget(self) -> int:
        return Budget.objects.create(tenant=self.org.tenant, scope="member",
                                     member=self.fresh_member(), limit_usd=1).pk


@dataclass
class Row:
    method: str
    path: Callable[[Ctx], str]
    body: Callable[[Ctx], Any] | None
    expect: dict[Role, int]
    route: str  # the route pattern, to check coverage


def _new_user(ctx: Ctx) -> dict[str, str]:
    n = Member.objects.count()
    return {"username": f"new-{n}", "email": f"new{n}@example.com", "password": PASSWORD}


MATRIX: dict[str, Row] = {
    "me": Row("GET", lambda c: "/api/v1/me", None,
              {PA: 200, TA: 200, DEV: 200, AUD: 200}, "api/v1/me"),
    "tenant list": Row("GET", lambda c: "/api/v1/tenants", None,
                       {PA: 200, TA: 403, DEV: 403, AUD: 403}, "api/v1/tenants"),
    "tenant create": Row("POST", lambda c: "/api/v1/tenants",
                         lambda c: {"slug": f"new-{c.role.replace('_', '-')}", "name": "New"},
                         {PA: 201, TA: 403, DEV: 403, AUD: 403}, "api/v1/tenants"),
    "tenant get": Row("GET", lambda c: f"/api/v1/tenants/{c.org.tenant.pk}", None,
                      {PA: 200, TA: 200, DEV: 200, AUD: 200},
                      "api/v1/tenants/<int:tenant_id>"),
    "tenant update": Row("PATCH", lambda c: f"/api/v1/tenants/{c.org.tenant.pk}",
                         lambda c: {"name": "Renamed"},
                         {PA: 200, TA: 403, DEV: 403, AUD: 403},
                         "api/v1/tenants/<int:tenant_id>"),
    "tenant privacy get": Row("GET", lambda c: f"/api/v1/tenants/{c.org.tenant.pk}/privacy",
                              None, {PA: 200, TA: 200, DEV: 200, AUD: 200},
                              "api/v1/tenants/<int:tenant_id>/privacy"),
    "tenant privacy update": Row("PATCH",
                                 lambda c: f"/api/v1/tenants/{c.org.tenant.pk}/privacy",
                                 lambda c: {"retention_days": 90},
                                 {PA: 200, TA: 200, DEV: 403, AUD: 403},
                                 "api/v1/tenants/<int:tenant_id>/privacy"),
    "tenant tool policy get": Row(
        "GET", lambda c: f"/api/v1/tenants/{c.org.tenant.pk}/tool-policy", None,
        {PA: 200, TA: 200, DEV: 200, AUD: 200}, "api/v1/tenants/<int:tenant_id>/tool-policy"),
    "tenant tool policy update": Row(
        "PATCH", lambda c: f"/api/v1/tenants/{c.org.tenant.pk}/tool-policy",
        lambda c: {"hosted_tools": "refuse"}, {PA: 200, TA: 200, DEV: 403, AUD: 403},
        "api/v1/tenants/<int:tenant_id>/tool-policy"),
    "member list": Row("GET", lambda c: "/api/v1/members", None,
                       {PA: 200, TA: 200, DEV: 403, AUD: 403}, "api/v1/members"),
    "member create": Row("POST", lambda c: "/api/v1/members",
                         lambda c: {**_new_user(c), "role": "developer"},
                         {PA: 201, TA: 201, DEV: 403, AUD: 403}, "api/v1/members"),
    "member get": Row("GET", lambda c: f"/api/v1/members/{c.fresh_member().pk}", None,
                      {PA: 200, TA: 200, DEV: 403, AUD: 403},
                      "api/v1/members/<int:member_id>"),
    "member update": Row("PATCH", lambda c: f"/api/v1/members/{c.fresh_member().pk}",
                         lambda c: {"role": "auditor"},
                         {PA: 200, TA: 200, DEV: 403, AUD: 403},
                         "api/v1/members/<int:member_id>"),
    "member deactivate": Row("DELETE", lambda c: f"/api/v1/members/{c.fresh_member().pk}",
                             None, {PA: 200, TA: 200, DEV: 403, AUD: 403},
                             "api/v1/members/<int:member_id>"),
    "key list": Row("GET", lambda c: "/api/v1/keys", None,
                    {PA: 200, TA: 200, DEV: 200, AUD: 200}, "api/v1/keys"),
    "key create": Row("POST", lambda c: "/api/v1/keys", lambda c: {"name": "mine"},
                      {PA: 201, TA: 201, DEV: 201, AUD: 201}, "api/v1/keys"),
    "key get": Row("GET", lambda c: f"/api/v1/keys/{c.fresh_key_id()}", None,
                   {PA: 200, TA: 200, DEV: 200, AUD: 200}, "api/v1/keys/<int:key_id>"),
    "key revoke": Row("DELETE", lambda c: f"/api/v1/keys/{c.fresh_key_id()}", None,
                      {PA: 200, TA: 200, DEV: 200, AUD: 200}, "api/v1/keys/<int:key_id>"),
    "deployment list": Row("GET", lambda c: "/api/v1/deployments", None,
                           {PA: 200, TA: 200, DEV: 200, AUD: 200}, "api/v1/deployments"),
    "deployment create": Row("POST", lambda c: "/api/v1/deployments",
                             lambda c: {"name": f"echo-{c.role}", "runtime": "echo"},
                             {PA: 201, TA: 403, DEV: 403, AUD: 403}, "api/v1/deployments"),
    "deployment get": Row("GET", lambda c: f"/api/v1/deployments/{c.deployment()}", None,
                          {PA: 200, TA: 200, DEV: 200, AUD: 200},
                          "api/v1/deployments/<name>"),
    "deployment update": Row("PATCH", lambda c: f"/api/v1/deployments/{c.deployment()}",
                             lambda c: {"max_batch_size": 4},
                             {PA: 200, TA: 403, DEV: 403, AUD: 403},
                             "api/v1/deployments/<name>"),
    "deployment scaling": Row("GET", lambda c: f"/api/v1/deployments/{c.deployment()}/scaling",
                              None, {PA: 200, TA: 403, DEV: 403, AUD: 403},
                              "api/v1/deployments/<name>/scaling"),
    # Model aliases are platform-wide, like deployments: platform admins' alone.
    "alias list": Row("GET", lambda c: "/api/v1/model-aliases", None,
                      {PA: 200, TA: 403, DEV: 403, AUD: 403}, "api/v1/model-aliases"),
    "alias create": Row("POST", lambda c: "/api/v1/model-aliases",
                        lambda c: {"name": f"alias-{c.role}",
                                   "targets": [{"deployment": c.deployment()}]},
                        {PA: 201, TA: 403, DEV: 403, AUD: 403}, "api/v1/model-aliases"),
    "alias get": Row("GET", lambda c: f"/api/v1/model-aliases/{c.alias()}", None,
                     {PA: 200, TA: 403, DEV: 403, AUD: 403},
                     "api/v1/model-aliases/<path:name>"),
    "alias update": Row("PATCH", lambda c: f"/api/v1/model-aliases/{c.alias()}",
                        lambda c: {"description": "d"},
                        {PA: 200, TA: 403, DEV: 403, AUD: 403},
                        "api/v1/model-aliases/<path:name>"),
    "alias delete": Row("DELETE", lambda c: f"/api/v1/model-aliases/{c.alias()}", None,
                        {PA: 204, TA: 403, DEV: 403, AUD: 403},
                        "api/v1/model-aliases/<path:name>"),
    # Auditors use no models, so they have no conversations; the others their own.
    "conversation list": Row("GET", lambda c: "/api/v1/conversations", None,
                             {PA: 200, TA: 200, DEV: 200, AUD: 403}, "api/v1/conversations"),
    "conversation create": Row("POST", lambda c: "/api/v1/conversations",
                               lambda c: {"title": "t"},
                               {PA: 201, TA: 201, DEV: 201, AUD: 403},
                               "api/v1/conversations"),
    "conversation get": Row("GET", lambda c: f"/api/v1/conversations/{c.fresh_conversation()}"
                            if c.role != AUD else "/api/v1/conversations/conv_x", None,
                            {PA: 200, TA: 200, DEV: 200, AUD: 403},
                            "api/v1/conversations/<conversation_id>"),
    "conversation delete": Row("DELETE",
                               lambda c: f"/api/v1/conversations/{c.fresh_conversation()}"
                               if c.role != AUD else "/api/v1/conversations/conv_x", None,
                               {PA: 204, TA: 204, DEV: 204, AUD: 403},
                               "api/v1/conversations/<conversation_id>"),
    # Stored responses (OpenAI's Responses API): read as conversations are.
    "response get": Row("GET", lambda c: f"/v1/responses/{c.fresh_response()}"
                        if c.role != AUD else f"/v1/responses/resp_{'0' * 24}", None,
                        {PA: 200, TA: 200, DEV: 200, AUD: 403},
                        "v1/responses/<response_id>"),
    "response delete": Row("DELETE", lambda c: f"/v1/responses/{c.fresh_response()}"
                           if c.role != AUD else f"/v1/responses/resp_{'0' * 24}", None,
                           {PA: 200, TA: 200, DEV: 200, AUD: 403},
                           "v1/responses/<response_id>"),
    "response input items": Row(
        "GET", lambda c: f"/v1/responses/{c.fresh_response()}/input_items"
        if c.role != AUD else f"/v1/responses/resp_{'0' * 24}/input_items", None,
        {PA: 200, TA: 200, DEV: 200, AUD: 403}, "v1/responses/<response_id>/input_items"),
    "rate limit list": Row("GET", lambda c: "/api/v1/governance/rate-limits", None,
                           {PA: 200, TA: 200, DEV: 403, AUD: 403},
                           "api/v1/governance/rate-limits"),
    # A tenant admin may limit the tenant's own keys; tenant-wide limits are the platform's.
    "rate limit create": Row("POST", lambda c: "/api/v1/governance/rate-limits",
                             lambda c: {"scope": "api_key", "requests_per_minute": 10},
                             {PA: 201, TA: 201, DEV: 403, AUD: 403},
                             "api/v1/governance/rate-limits"),
    "rate limit get": Row("GET", lambda c: f"/api/v1/governance/rate-limits/{c.fresh_limit()}",
                          None, {PA: 200, TA: 200, DEV: 403, AUD: 403},
                          "api/v1/governance/rate-limits/<int:policy_id>"),
    "rate limit update": Row("PATCH",
                             lambda c: f"/api/v1/governance/rate-limits/{c.fresh_limit()}",
                             lambda c: {"requests_per_minute": 20},
                             {PA: 200, TA: 200, DEV: 403, AUD: 403},
                             "api/v1/governance/rate-limits/<int:policy_id>"),
    "rate limit delete": Row("DELETE",
                             lambda c: f"/api/v1/governance/rate-limits/{c.fresh_limit()}",
                             None, {PA: 204, TA: 204, DEV: 403, AUD: 403},
                             "api/v1/governance/rate-limits/<int:policy_id>"),
    "quota list": Row("GET", lambda c: "/api/v1/governance/quotas", None,
                      {PA: 200, TA: 200, DEV: 403, AUD: 403}, "api/v1/governance/quotas"),
    "quota create": Row("POST", lambda c: "/api/v1/governance/quotas",
                        lambda c: {"tenant_id": c.org.tenant.pk, "max_requests": 5},
                        {PA: 201, TA: 403, DEV: 403, AUD: 403}, "api/v1/governance/quotas"),
    "quota get": Row("GET", lambda c: f"/api/v1/governance/quotas/{c.fresh_quota()}", None,
                     {PA: 200, TA: 200, DEV: 403, AUD: 403},
                     "api/v1/governance/quotas/<int:quota_id>"),
    "quota update": Row("PATCH", lambda c: f"/api/v1/governance/quotas/{c.fresh_quota()}",
                        lambda c: {"max_requests": 50},
                        {PA: 200, TA: 403, DEV: 403, AUD: 403},
                        "api/v1/governance/quotas/<int:quota_id>"),
    "quota delete": Row("DELETE", lambda c: f"/api/v1/governance/quotas/{c.fresh_quota()}",
                        None, {PA: 204, TA: 403, DEV: 403, AUD: 403},
                        "api/v1/governance/quotas/<int:quota_id>"),
    "price list": Row("GET", lambda c: "/api/v1/governance/prices", None,
                      {PA: 200, TA: 200, DEV: 200, AUD: 200}, "api/v1/governance/prices"),
    "price create": Row("POST", lambda c: "/api/v1/governance/prices",
                        lambda c: {"model": f"m-{token_hex(4)}", "input_per_mtok_usd": 1,
                                   "output_per_mtok_usd": 2},
                        {PA: 201, TA: 403, DEV: 403, AUD: 403}, "api/v1/governance/prices"),
    "price get": Row("GET", lambda c: f"/api/v1/governance/prices/{c.fresh_price()}", None,
                     {PA: 200, TA: 200, DEV: 200, AUD: 200},
                     "api/v1/governance/prices/<int:price_id>"),
    "price delete": Row("DELETE", lambda c: f"/api/v1/governance/prices/{c.fresh_price()}",
                        None, {PA: 204, TA: 403, DEV: 403, AUD: 403},
                        "api/v1/governance/prices/<int:price_id>"),
    "spend": Row("GET", lambda c: "/api/v1/governance/spend?from=2026-01-01T00:00:00Z"
                 "&to=2026-01-02T00:00:00Z&group_by=key", None,
                 {PA: 200, TA: 200, DEV: 200, AUD: 200}, "api/v1/governance/spend"),
    "billing get": Row("GET", lambda c: f"/api/v1/tenants/{c.org.tenant.pk}/billing", None,
                       {PA: 200, TA: 200, DEV: 403, AUD: 403},
                       "api/v1/tenants/<int:tenant_id>/billing"),
    "billing update": Row("PATCH", lambda c: f"/api/v1/tenants/{c.org.tenant.pk}/billing",
                          lambda c: {"time_zone": "UTC"},
                          {PA: 200, TA: 200, DEV: 403, AUD: 403},
                          "api/v1/tenants/<int:tenant_id>/billing"),
    "guardrail list": Row("GET", lambda c: "/api/v1/governance/guardrails", None,
                          {PA: 200, TA: 200, DEV: 403, AUD: 200},
                          "api/v1/governance/guardrails"),
    "guardrail create": Row("POST", lambda c: "/api/v1/governance/guardrails",
                            lambda c: {"name": "m", "guard": "pii", "phase": "pre",
                                       "action": "mask", "scope": "tenant",
                                       "tenant_id": c.org.tenant.pk},
                            {PA: 201, TA: 201, DEV: 403, AUD: 403},
                            "api/v1/governance/guardrails"),
    "guardrail get": Row("GET", lambda c: f"/api/v1/governance/guardrails/{c.fresh_guard()}",
                         None, {PA: 200, TA: 200, DEV: 403, AUD: 200},
                         "api/v1/governance/guardrails/<int:policy_id>"),
    "guardrail update": Row("PATCH",
                            lambda c: f"/api/v1/governance/guardrails/{c.fresh_guard()}",
                            lambda c: {"shadow": True}, {PA: 200, TA: 200, DEV: 403, AUD: 403},
                            "api/v1/governance/guardrails/<int:policy_id>"),
    "guardrail delete": Row("DELETE",
                            lambda c: f"/api/v1/governance/guardrails/{c.fresh_guard()}",
                            None, {PA: 204, TA: 204, DEV: 403, AUD: 403},
                            "api/v1/governance/guardrails/<int:policy_id>"),
    "budget list": Row("GET", lambda c: "/api/v1/governance/budgets", None,
                       {PA: 200, TA: 200, DEV: 403, AUD: 200}, "api/v1/governance/budgets"),
    "budget create": Row("POST", lambda c: "/api/v1/governance/budgets",
                         lambda c: {"tenant_id": c.org.tenant.pk, "scope": "member",
                                    "member_id": c.fresh_member().pk, "limit_usd": 1},
                         {PA: 201, TA: 201, DEV: 403, AUD: 403}, "api/v1/governance/budgets"),
    "budget get": Row("GET", lambda c: f"/api/v1/governance/budgets/{c.fresh_budget()}",
                      None, {PA: 200, TA: 200, DEV: 403, AUD: 200},
                      "api/v1/governance/budgets/<int:budget_id>"),
    "budget update": Row("PATCH", lambda c: f"/api/v1/governance/budgets/{c.fresh_budget()}",
                         lambda c: {"limit_usd": 2}, {PA: 200, TA: 200, DEV: 403, AUD: 403},
                         "api/v1/governance/budgets/<int:budget_id>"),
    "budget delete": Row("DELETE",
                         lambda c: f"/api/v1/governance/budgets/{c.fresh_budget()}",
                         None, {PA: 204, TA: 204, DEV: 403, AUD: 403},
                         "api/v1/governance/budgets/<int:budget_id>"),
    "breaker get": Row("GET", lambda c: f"/api/v1/governance/breakers/{c.deployment()}", None,
                       {PA: 200, TA: 403, DEV: 403, AUD: 403},
                       "api/v1/governance/breakers/<name>"),
    "breaker update": Row("PUT", lambda c: f"/api/v1/governance/breakers/{c.deployment()}",
                          lambda c: {"failure_rate": 0.4},
                          {PA: 200, TA: 403, DEV: 403, AUD: 403},
                          "api/v1/governance/breakers/<name>"),
    "breaker reset": Row("POST",
                         lambda c: f"/api/v1/governance/breakers/{c.deployment()}/reset",
                         None, {PA: 200, TA: 403, DEV: 403, AUD: 403},
                         "api/v1/governance/breakers/<name>/reset"),
    # Auditors read usage (billing review); developers do not.
    "redaction list": Row("GET", lambda c: "/api/v1/governance/redaction-patterns", None,
                          {PA: 200, TA: 200, DEV: 403, AUD: 403},
                          "api/v1/governance/redaction-patterns"),
    "redaction create": Row("POST", lambda c: "/api/v1/governance/redaction-patterns",
                            lambda c: {"label": "EMP", "pattern": r"EMP-\d{6}"},
                            {PA: 201, TA: 201, DEV: 403, AUD: 403},
                            "api/v1/governance/redaction-patterns"),
    "redaction delete": Row("DELETE",
                            lambda c: f"/api/v1/governance/redaction-patterns/{c.fresh_pattern()}",
                            None, {PA: 204, TA: 204, DEV: 403, AUD: 403},
                            "api/v1/governance/redaction-patterns/<int:pattern_id>"),
    "audit events": Row("GET", lambda c: "/api/v1/audit/events", None,
                        {PA: 200, TA: 200, DEV: 403, AUD: 200}, "api/v1/audit/events"),
    "audit export create": Row("POST", lambda c: "/api/v1/audit/exports",
                               lambda c: {"format": "csv"},
                               {PA: 202, TA: 202, DEV: 403, AUD: 202}, "api/v1/audit/exports"),
    "audit export get": Row("GET", lambda c: f"/api/v1/audit/exports/{c.fresh_export()}", None,
                            {PA: 200, TA: 200, DEV: 403, AUD: 200},
                            "api/v1/audit/exports/<int:export_id>"),
    "audit export download": Row(
        "GET", lambda c: f"/api/v1/audit/exports/{c.fresh_export()}/download", None,
        {PA: 409, TA: 409, DEV: 403, AUD: 409},
        "api/v1/audit/exports/<int:export_id>/download"),
    "usage list": Row("GET", lambda c: "/api/v1/governance/usage", None,
                      {PA: 200, TA: 200, DEV: 403, AUD: 200}, "api/v1/governance/usage"),
}

CASES = [(name, role) for name in MATRIX for role in (PA, TA, DEV, AUD)]


def _call(client: ApiClient, row: Row, ctx: Ctx) -> Any:
    body = row.body(ctx) if row.body else None
    return client.call(row.method, row.path(ctx), body)


@pytest.mark.parametrize(("endpoint", "role"), CASES, ids=[f"{e}-{r}" for e, r in CASES])
def test_role_gets_expected_status(alice: Org, ops: Org, endpoint: str, role: Role) -> None:
    org = ops if role == PA else alice
    row = MATRIX[endpoint]
    response = _call(org.client(role), row, Ctx(org, role))
    expected = row.expect[role]
    if expected >= 400:
        error = assert_openai_error(response, expected)
        if expected == 403:
            assert error["type"] == "permission_error"
    else:
        assert response.status == expected, response.body


@pytest.mark.parametrize("endpoint", list(MATRIX))
def test_anonymous_gets_401(alice: Org, endpoint: str) -> None:
    row = MATRIX[endpoint]
    assert_openai_error(_call(ApiClient(), row, Ctx(alice, TA)), 401)


def test_matrix_covers_every_route() -> None:
    routes = set()
    for pattern in get_resolver().url_patterns:
        for sub in getattr(pattern, "url_patterns", []):
            route = str(sub.pattern)
            if route.startswith(("api/v1/", "v1/responses")):
                routes.add(route)
    covered = {row.route for row in MATRIX.values()}
    assert routes == covered, f"routes without a matrix row: {routes - covered}"
