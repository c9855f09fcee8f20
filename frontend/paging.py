"""Keyset pagination for every list: `?after=<id>` (oldest first) or `?before=<id>`
(newest first). No OFFSET and no COUNT(*): the hundredth page of 100,000 keys costs what
the first does (an index range scan on the primary key).

A cursor is 1 to 19 ASCII digits (an id); anything else ("²", which str.isdigit accepts
and int() refuses, a 4,300-digit number, "-1") is ignored: the list's first page."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet
from django.http import HttpRequest, QueryDict

PER_PAGE = 50
_MAX_ID = 2**63 - 1
_CURSOR = re.compile(r"[0-9]{1,19}")  # ASCII only: \d would take any script's digits


@dataclass
class Page:
    rows: list[Any]
    next_url: str | None  # None on the last page
    first_url: str | None  # None on the first page


def _url(request: HttpRequest, **params: Any) -> str:
    query: QueryDict = request.GET.copy()
    for key in ("after", "before"):
        query.pop(key, None)
    for key, value in params.items():
        query[key] = str(value)
    return f"{request.path}?{query.urlencode()}"


def _cursor(raw: str) -> int | None:
    if not _CURSOR.fullmatch(raw):
        return None
    # Ids are 64-bit: a larger 19-digit cursor means "past the end" (the database
    # would refuse the number itself).
    return min(int(raw), _MAX_ID)


def keyset(request: HttpRequest, rows: QuerySet[Any], *, newest_first: bool = False,
           per_page: int = PER_PAGE) -> Page:
    cursor = _cursor(request.GET.get("before" if newest_first else "after", ""))
    if newest_first:
        rows = rows.order_by("-pk")
        if cursor is not None:
            rows = rows.filter(pk__lt=cursor)
    else:
        rows = rows.order_by("pk")
        if cursor is not None:
            rows = rows.filter(pk__gt=cursor)
    found = list(rows[:per_page + 1])
    more = len(found) > per_page
    found = found[:per_page]
    key = "before" if newest_first else "after"
    first = None
    if cursor is not None:
        query = request.GET.copy()
        query.pop(key, None)
        first = f"{request.path}?{query.urlencode()}"
    return Page(rows=found, next_url=_url(request, **{key: found[-1].pk}) if more else None,
                first_url=first)
