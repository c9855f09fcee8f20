"""Schemathesis against the management API's OpenAPI document, as each role: whatever
the generated input, no server error (bad input is a typed 4xx). Derandomized: the same
cases every run; a larger `SLUICE_FUZZ_EXAMPLES` explores further.

Run on its own, not in the suite (it calls the ASGI app in-process on schemathesis' own
event loop; after the suite's live servers have run in other loops, process-wide async
caches bound to those loops make it fail for reasons that are not the API's):

    ./dev.sh test tests/bench/fuzz_api_schema.py      (~4 min; 224 cases, 0 server errors)
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from sluice.asgi import application
from tenants.roles import Role
from tests.conftest import make_org

schema = schemathesis.openapi.from_asgi("/api/openapi.json", application,
                                        headers={"Host": "localhost"})
EXAMPLES = int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "4"))


@pytest.fixture(params=[Role.PLATFORM_ADMIN, Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR])
def token(request: pytest.FixtureRequest, transactional_db: None) -> str:
    role = request.param
    return make_org("fuzz", [role]).keys[role]


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_input_makes_a_server_error(case: Any, token: str) -> None:
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}",
                    "Host": "localhost"}
    response = case.call()
    assert response.status_code < 500, (case.method, case.path, response.text[:300])
