"""sluice.wirejson: the pipeline's JSON for Redis. Compact and UTF-8 as it is; what
orjson refuses (an integer beyond 64 bits, a non-string key) still encodes, as the
standard encoder writes it, instead of failing the call."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal

from sluice import wirejson


def test_compact_and_utf8() -> None:
    text = wirejson.dumps({"t": "done", "text": "héllo ✓", "ids": [1, 2]})
    assert text == '{"t":"done","text":"héllo ✓","ids":[1,2]}'


def test_what_orjson_refuses_still_encodes() -> None:
    huge = {"seed": 10**30, "n": 1}
    assert json.loads(wirejson.dumps(huge)) == huge
    assert json.loads(wirejson.dumps({1: "a"})) == {"1": "a"}


def test_default_covers_other_types() -> None:
    at = datetime(2026, 12, 3, tzinfo=UTC)
    out = json.loads(wirejson.dumps({"d": Decimal("1.5"), "at": at}, default=str))
    assert out["d"] == "1.5"
    assert datetime.fromisoformat(out["at"]) == at
