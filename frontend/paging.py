"""Keyset pagination for every list: `?after=<id>` (oldest first) or `?before=<id>`
(newest first). No OFFSET and no COUNT(*): the hundredth page of 100,000 keys costs what
the first does (an index range scan on the primary key)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet
from django.http import HttpRequest, QueryDict

PER_PAGE = 50
_MAX_ID = 2**63 - 1


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


def keyset(request: HttpRequest, rows: QuerySet[Any], *, newest_first: bool = False,
           per_page: int = PER_PAGE) -> Page:
    raw = request.GET.get("before" if newest_first else "after", "")
    # Ids are 64-bit: a larger cursor means "past the end" (the database would refuse it).
    cursor = min(int(raw), _MAX_ID) if raw.isdigit() else None
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
