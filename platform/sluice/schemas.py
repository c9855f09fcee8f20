"""Boundary schema base: unknown fields are an error, never silently dropped (so a
caller cannot smuggle `tenant_id` or `role` into an object through mass assignment)."""

from __future__ import annotations

from ninja import Schema
from pydantic import ConfigDict


class StrictSchema(Schema):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)
