"""Schemathesis against the live server's own OpenAPI document, once per role.

The document is fetched from the running server (uvicorn on a loopback port), and every
operation in it (the management API, and the OpenAI routes the lean ASGI path serves)
is called over real HTTP with generated input, as a platform admin, a tenant admin, a
developer and an auditor, each call with a fresh key of that role. Whatever the input
and whoever asks: no server error (the inference routes' documented, retriable 503/504
aside), and the answer conforms to the document: a documented status (success, or a
4XX with the OpenAI error envelope), the documented content type, a body that validates
against the documented schema. Derandomized: the same cases every run;
SLUICE_FUZZ_EXAMPLES (default 4 per operation and role) explores further.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tenants.roles import Role
from tenants.services import apikey_create
from tests.conftest import make_org, principal_for
from tests.streaming.conftest import Live

EXAMPLES = int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "4"))
# The inference routes may answer 503 or 504 by design (overloaded; a deadline that
# passed, e.g. on a model no worker serves: a platform admin's generated POST
# /api/v1/deployments makes such models). Both are documented, typed and retriable.
RETRIABLE_ON = ("/v1/chat/completions", "/v1/embeddings", "/v1/completions",
                "/v1/messages", "/v1/messages/count_tokens", "/v1/responses")


@schemathesis.check
def no_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    status = response.status_code
    if status >= 500 and not (status in (503, 504) and case.path in RETRIABLE_ON):
        raise AssertionError(f"server error {status}: {response.text[:300]}")
    return None


CHECKS = [no_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def _fuzz(operation: Any, base_url: str, headers: dict[str, str]) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        # The role's own key, over whatever the security scheme made Schemathesis
        # generate (a random bearer token: every call would be a 401).
        case.headers = {**(case.headers or {}), **headers}
        response = case.call(base_url=base_url, timeout=15)
        case.validate_response(response, checks=CHECKS)

    run()


def _describe(error: BaseException) -> str:
    """An error and, for a group (Hypothesis and Schemathesis report several), each of
    its members."""
    if isinstance(error, BaseExceptionGroup):
        return f"{error}\n" + "\n".join(f"- {_describe(e)}" for e in error.exceptions)
    return f"{type(error).__name__}: {error}"


@pytest.mark.parametrize("role", [Role.PLATFORM_ADMIN, Role.TENANT_ADMIN, Role.DEVELOPER,
                                  Role.AUDITOR])
def test_every_operation_answers_to_the_document(live: Live, role: Role,
                                                 settings: Any) -> None:
    # A platform admin's generated POST /api/v1/deployments makes models no worker
    # serves; a chat with one waits for a worker until its deadline, then gets a 504.
    settings.SLUICE_REQUEST_TIMEOUT_S = 2
    base_url = live.base_url.removesuffix("/v1")
    schema = schemathesis.openapi.from_url(f"{base_url}/api/openapi.json")
    member = make_org("fuzz", [role]).members[role]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 40, "the document lost its operations"
    failures = []
    for operation in operations:
        # A key of its own per operation: a generated DELETE /api/v1/keys/{id} may well
        # revoke the caller's key, and every later call would be a 401.
        key = apikey_create(actor=principal_for(member), name="fuzz", role=role).secret
        try:
            _fuzz(operation, base_url, {"Authorization": f"Bearer {key}"})
        except (Exception, BaseExceptionGroup) as error:  # schemathesis' FailureGroup
            failures.append(f"{operation.label}: {_describe(error)[:1500]}")
    assert not failures, f"{len(failures)} operations failed as {role}:\n" + "\n".join(failures)
