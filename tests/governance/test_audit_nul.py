"""A NUL in what a caller sends never reaches PostgreSQL text through the audit log: an
event the writer cannot insert would fail every later batch (the stream redelivers it),
stopping the audit log for every tenant."""

from __future__ import annotations

import httpx
import pytest

from governance import audit
from governance.models import AuditEvent
from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow


def test_a_nul_in_a_prompt_is_audited_and_the_audit_log_goes_on(live: Live) -> None:
    # Given a developer's key
    org = make_org("alice", [Role.DEVELOPER])
    headers = {"Authorization": f"Bearer {org.keys[Role.DEVELOPER]}"}

    def chat(text: str) -> httpx.Response:
        return httpx.post(f"{live.base_url}/chat/completions", headers=headers, timeout=30,
                          json={"model": "echo",
                                "messages": [{"role": "user", "content": text}]})

    # When a call's prompt holds a NUL, and another call follows it
    assert chat("before\x00after").status_code == 200
    assert chat("next call").status_code == 200
    audit.drain()
    # then both calls are in the audit log, the NUL stored as U+FFFD.
    excerpts = list(AuditEvent.objects.filter(action="chat.completions")
                    .values_list("request_excerpt", flat=True))
    assert any("before\ufffdafter" in e for e in excerpts), excerpts
    assert any("next call" in e for e in excerpts), excerpts
    assert audit.verify("alice") == []
