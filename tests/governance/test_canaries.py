"""Personal data planted in prompts must not come out anywhere Sluice stores or emits:
the database (every table), the log output, audit exports. (Traces arrive with the
observability issue; their attributes will go through the same engine.)"""

from __future__ import annotations

import base64
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from django.apps import apps

from governance import audit, exports
from governance.models import AuditExport
from sluice.pii.logredact import RedactingFilter
from tenants.roles import Role
from tests.conftest import Org, make_org
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow


def _jwt() -> str:
    part = base64.urlsafe_b64encode(json.dumps({"alg": "HS256"}).encode()).decode()
    body = base64.urlsafe_b64encode(json.dumps({"sub": "canary"}).encode()).decode()
    return f"{part.rstrip('=')}.{body.rstrip('=')}.c2lnbmF0dXJlX2NhbmFyeQ"


CANARIES = {
    "ssn": "219-09-9999",
    "card": "4111 1111 1111 1111",
    "email": "canary.jane@example.org",
    "phone": "+1 415 555 2671",
    "iban": "DE89 3704 0044 0532 0130 00",
    "jwt": _jwt(),
    "key": "sk-proj-CANARYkey0123456789abcdefXYZ",
}
# The same secrets as they may be stored without separators.
NEEDLES = [*CANARIES.values(), "219099999", "4111111111111111", "14155552671",
           "DE89370400440532013000", "canary.jane"]
PROMPT = " / ".join(f"{k}: {v}" for k, v in CANARIES.items())


@pytest.fixture
def log_output() -> Iterator[io.StringIO]:
    """The configured console handler (with its redaction filter), writing to a buffer."""
    root = logging.getLogger()
    handlers = [h for h in root.handlers
                if any(isinstance(f, RedactingFilter) for f in h.filters)]
    assert handlers, "the console handler has no redaction filter"
    buffer = io.StringIO()
    old = [h.setStream(buffer) for h in handlers]  # type: ignore[attr-defined]
    level = root.level
    root.setLevel(logging.INFO)
    yield buffer
    root.setLevel(level)
    for handler, stream in zip(handlers, old, strict=True):
        handler.setStream(stream)  # type: ignore[attr-defined]


def _scan_database() -> list[str]:
    found = []
    for model in apps.get_models():
        for row in model._default_manager.all().values():
            text = json.dumps(row, default=str)
            found += [f"{model.__name__}: {n}" for n in NEEDLES if n in text]
    return found


def test_no_canary_leaves_the_platform(live: Live, tiny: str, settings: Any,
                                       log_output: io.StringIO, tmp_path: Path) -> None:
    settings.STATE_DIR = tmp_path
    org: Org = make_org("canary", [Role.DEVELOPER, Role.AUDITOR])
    key = org.keys[Role.DEVELOPER]
    client = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0)
    conversation = org.client(Role.DEVELOPER).post("/api/v1/conversations",
                                                   {"title": "c"}).body["id"]
    # JSON, with a stored conversation; SSE; embeddings; a tool call; refused calls
    client.chat.completions.create(model="echo", messages=[{"role": "user", "content": PROMPT}],
                                   extra_body={"conversation_id": conversation})
    list(client.chat.completions.create(model="echo", stream=True, messages=[
        {"role": "user", "content": PROMPT}]))
    client.embeddings.create(model="minilm", input=[PROMPT])
    client.chat.completions.create(
        model=tiny, max_tokens=24, tool_choice="required",
        messages=[{"role": "user", "content": f"{CANARIES['email']} {CANARIES['ssn']}"}],
        tools=[{"type": "function", "function": {"name": "lookup", "parameters": {
            "type": "object", "properties": {"q": {"type": "string"}}}}}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=CANARIES["email"], messages=[
            {"role": "user", "content": PROMPT}])
    bad = httpx.post(f"{live.base_url}/chat/completions", headers={
        "Authorization": f"Bearer {key}"}, json={"model": "echo", "messages": PROMPT})
    assert bad.status_code == 400
    assert not [n for n in NEEDLES if n in bad.text]
    # what a careless log line or an exception with user data would write
    logging.getLogger("sluice.test").warning("user wrote %s", PROMPT)
    try:
        raise ValueError(f"cannot parse {CANARIES['card']}")
    except ValueError:
        logging.getLogger("sluice.test").exception("failed")
    audit.drain()
    # an auditor's export of everything
    export = AuditExport.objects.create(tenant=org.tenant, requested_by="t", format="jsonl")
    exported = Path(exports.run(export.pk)).read_text()
    assert exported.count("\n") >= 5
    assert "[CARD]" in exported and "[EMAIL]" in exported

    assert _scan_database() == []
    logs = log_output.getvalue()
    assert "[CARD]" in logs and "failed" in logs
    assert [n for n in NEEDLES if n in logs] == []
    assert [n for n in NEEDLES if n in exported] == []
