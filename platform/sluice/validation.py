"""Model validation as the API's typed error: a failed full_clean() is a 422 naming the
field (or no field, for rules that span several)."""

from __future__ import annotations

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db.models import Model

from sluice.errors import Unprocessable


def validate(instance: Model, *, exclude: list[str] | None = None) -> None:
    try:
        instance.full_clean(exclude=exclude, validate_unique=False)  # duplicates: 409
    except ValidationError as exc:
        field, messages = next(iter(exc.message_dict.items()))
        if field == NON_FIELD_ERRORS:
            raise Unprocessable(" ".join(messages)) from None
        raise Unprocessable(f"{field}: {' '.join(messages)}", param=field) from None
