"""Boundary schema base and the value types every management API schema shares.

StrictSchema: unknown fields are an error, never silently dropped (so a caller cannot
smuggle `tenant_id` or `role` into an object through mass assignment).

The types below are the one definition of what a number or a piece of text may be at
the edge; the management API's schemas and query parameters use them, so a value the
database cannot hold is a 422 naming the field, never a 500 further in:
- `Id`: an object id, a positive 64-bit signed integer (PostgreSQL's bigint, SQLite's
  INTEGER); a larger number overflows the driver.
- `Offset`: list paging; an offset past MAX_OFFSET pages nothing anyone reads.
- `Line`: one line of text a person typed (names, titles, usernames, filters): no C0
  control character and no DEL. PostgreSQL cannot store a NUL in text at all, and the
  others hide or forge text in logs and pages.
- `Text`: free text (descriptions): the same, but tab, line feed and carriage return.
Narrow them where used: `Annotated[Line, StringConstraints(max_length=200)]`.
"""

from __future__ import annotations

from typing import Annotated

from ninja import Schema
from pydantic import ConfigDict, Field, StringConstraints

MAX_ID = 2**63 - 1
MAX_OFFSET = 10**9

# Patterns (also in the OpenAPI document, so clients and fuzzers see them); ECMA and
# Python read them alike.
LINE_PATTERN = r"^[^\x00-\x1f\x7f]*$"
TEXT_PATTERN = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]*$"
CONTROL_PATTERNS = (LINE_PATTERN, TEXT_PATTERN)

Id = Annotated[int, Field(ge=1, le=MAX_ID)]
Offset = Annotated[int, Field(ge=0, le=MAX_OFFSET)]
Line = Annotated[str, StringConstraints(pattern=LINE_PATTERN)]
Text = Annotated[str, StringConstraints(pattern=TEXT_PATTERN)]


class StrictSchema(Schema):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)
