"""A tenant's own redaction patterns (and a words guardrail's regexes) checked before
they are stored: only a pattern that runs in linear time on any input is accepted."""

from __future__ import annotations

import re
from re import _constants as sre_constants  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any


class UnsafePattern(ValueError):
    pass


_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT,
            getattr(sre_constants, "POSSESSIVE_REPEAT", sre_constants.MAX_REPEAT))


def compile_tenant_pattern(source: str) -> re.Pattern[str]:
    """A tenant's extra pattern, refused unless it is safe to run on any input: at most
    200 characters, no backreferences or lookarounds, and no repetition or alternation
    inside a repetition (the shapes that make backtracking regexes exponential)."""
    if not source or len(source) > 200:
        raise UnsafePattern("A pattern must have 1 to 200 characters.")
    try:
        parsed = sre_parse.parse(source)
    except re.error as exc:
        raise UnsafePattern(f"Not a valid regular expression: {exc.msg}.") from None

    def walk(items: Any, inside_repeat: bool) -> None:
        for op, arg in items:
            if op in (sre_constants.GROUPREF, sre_constants.GROUPREF_EXISTS,
                      sre_constants.ASSERT, sre_constants.ASSERT_NOT):
                raise UnsafePattern("Backreferences and lookarounds are not allowed.")
            if op in _REPEATS:
                if inside_repeat:
                    raise UnsafePattern("A repetition inside a repetition is not allowed.")
                walk(arg[2], True)
            elif op == sre_constants.SUBPATTERN:
                walk(arg[-1], inside_repeat)
            elif op == sre_constants.BRANCH:
                if inside_repeat:
                    raise UnsafePattern("An alternation inside a repetition is not allowed.")
                for branch in arg[1]:
                    walk(branch, inside_repeat)
            elif op == sre_constants.ATOMIC_GROUP:
                walk(arg, inside_repeat)

    walk(parsed, False)
    compiled = re.compile(source)
    if compiled.match(""):
        raise UnsafePattern("A pattern must not match the empty string.")
    return compiled
