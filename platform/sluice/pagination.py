"""The management API's list paging: ninja's `?limit=&offset=` with both numbers
range-checked (limit 1..NINJA_PAGINATION_MAX_LIMIT, offset sluice.schemas.Offset), so
`?offset=99999999999999999999` is a 422 naming `offset` instead of an integer overflow
in the database driver. Every list endpoint pages with `@paginate(Pagination)`."""

from __future__ import annotations

from typing import Annotated

from django.conf import settings
from ninja import Field, Schema
from ninja.pagination import LimitOffsetPagination

from sluice.schemas import Offset


class Pagination(LimitOffsetPagination):
    class Input(Schema):
        limit: Annotated[int, Field(ge=1, le=settings.NINJA_PAGINATION_MAX_LIMIT)] = \
            settings.NINJA_PAGINATION_PER_PAGE
        offset: Offset = 0
