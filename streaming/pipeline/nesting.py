"""How deep a request's JSON may nest: checked at each protocol's edge, before anything
walks the request recursively.

Parsers stop far deeper than the pipeline can go: orjson parses 1,024 levels, while
orjson.dumps (the queue's encoder) refuses past 255 and json, repr and protobuf's Struct
conversion raise RecursionError near Python's 1,000-frame limit. A request nested deeper
than MAX_JSON_DEPTH is a 400 (`json_too_deep`) at the edge instead of a server error
wherever it is first walked. 64 is far above what real requests nest: a JSON schema for
structured outputs may nest 10 objects (OpenAI's limit), about 25 JSON levels inside a
body.
"""

from __future__ import annotations

from typing import Any

from sluice.errors import BadRequest

MAX_JSON_DEPTH = 64


def json_depth(value: Any, *, stop_after: int = MAX_JSON_DEPTH) -> int:
    """How many levels of lists and dicts `value` nests (a scalar: 0, `[]`: 1, `[{}]`:
    2); the count stops at `stop_after` + 1. Iterative: no recursion however deep."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > stop_after:
            return deepest
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, dict | list))
    return deepest


def check_depth(value: Any, *, what: str = "The request body",
                limit: int = MAX_JSON_DEPTH) -> None:
    """Raise BadRequest (`json_too_deep`) when `value` nests deeper than `limit`."""
    if json_depth(value, stop_after=limit) > limit:
        raise BadRequest(f"{what} nests JSON more than {limit} levels deep.",
                         code="json_too_deep")
