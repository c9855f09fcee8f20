"""Tool schemas, checked without torch (the gateway validates requests with this)."""

from __future__ import annotations

from typing import Any

TOOL_MARKER = "<tool_call>"  # how the model starts a tool call (see inference/tools.py)


MAX_LENGTH = 100_000  # the largest maxLength a string may declare


class SchemaError(ValueError):
    pass


def validate(schema: Any, path: str = "parameters") -> None:
    """Raise SchemaError if the schema uses anything this decoder cannot honour."""
    if not isinstance(schema, dict):
        raise SchemaError(f"{path} must be a JSON schema object")
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values or not all(
                v is None or isinstance(v, str | int | float | bool) for v in values):
            raise SchemaError(f"{path}.enum must be a non-empty list of scalars")
        return
    kind = schema.get("type")
    for unsupported in ("anyOf", "oneOf", "allOf", "$ref", "not", "pattern", "items",
                        "minLength", "format", "minimum", "maximum"):
        if unsupported in schema:
            raise SchemaError(f"{path} uses '{unsupported}', which is not supported")
    if "maxLength" in schema:
        # A count (gRPC's Struct carries every number as a float: 20.0 is 20).
        limit = schema["maxLength"]
        if isinstance(limit, bool) or not isinstance(limit, int | float) \
                or limit != int(limit) or not 1 <= limit <= MAX_LENGTH:
            raise SchemaError(f"{path}.maxLength must be a whole number from 1 to {MAX_LENGTH}")
    if kind == "object":
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"{path}.properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or any(
                not isinstance(r, str) or r not in props for r in required):
            raise SchemaError(f"{path}.required names a property that is not defined")
        for name, sub in props.items():
            validate(sub, f"{path}.properties.{name}")
    elif kind not in ("string", "integer", "number", "boolean", "null"):
        raise SchemaError(f"{path}.type {kind!r} is not supported")
