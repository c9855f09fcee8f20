"""Schemathesis against the live server's own OpenAPI document, once per role.

The document is fetched from the running server (uvicorn on a loopback port), and every
operation in it is called over real HTTP with generated input, as a platform admin, a
tenant admin, a developer and an auditor. Whatever the input and whoever asks: no server
error, and the answer conforms to the document: a documented status (success, or a 4XX
with the OpenAI error envelope), the documented content type, a body that validates
against the documented schema. Derandomized: the same cases every run;
SLUICE_FUZZ_EXAMPLES (default 4 per operation and role) explores further.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live

EXAMPLES = int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "4"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def _fuzz(operation: Any, base_url: str, headers: dict[str, str]) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        response = case.call(base_url=base_url, headers=headers, timeout=30)
        case.validate_response(response, checks=CHECKS)

    run()


@pytest.mark.parametrize("role", [Role.PLATFORM_ADMIN, Role.TENANT_ADMIN, Role.DEVELOPER,
                                  Role.AUDITOR])
def test_every_operation_answers_to_the_document(live: Live, role: Role) -> None:
    base_url = live.base_url.removesuffix("/v1")
    schema = schemathesis.openapi.from_url(f"{base_url}/api/openapi.json")
    headers = {"Authorization": f"Bearer {make_org('fuzz', [role]).keys[role]}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 40, "the document lost its operations"
    failures = []
    for operation in operations:
        try:
            _fuzz(operation, base_url, headers)
        except (Exception, BaseExceptionGroup) as error:  # schemathesis' FailureGroup
            failures.append(f"{operation.label}: {str(error)[:600]}")
    assert not failures, f"{len(failures)} operations failed as {role}:\n" + "\n".join(failures)
