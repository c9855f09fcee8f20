"""`manage.py importprices FILE [--model SLUICE=LITELLM ...] [--valid-from ISO]`: price
versions from a LiteLLM `model_prices_and_context_window.json` that the operator
supplies (nothing is fetched). Without --model, every entry whose name is a Sluice model
name and that prices tokens; with it, only the named entries, each under the Sluice
name given (`--model gpt-4o-mini=openai/gpt-4o-mini`). Each row is a new version from
--valid-from (default now), audited as the system's `price.create`; a model that has a
version from that very time already is reported and left as it is."""

from __future__ import annotations

import json
import re
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from governance import pricing, services
from sluice.errors import ApiError

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


class Command(BaseCommand):
    help = "Import price versions from a LiteLLM model_prices_and_context_window.json file."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", type=Path)
        parser.add_argument("--model", action="append", default=[], metavar="SLUICE=LITELLM",
                            help="import only this entry, under this Sluice model name "
                                 "(repeatable)")
        parser.add_argument("--valid-from", default=None,
                            help="ISO 8601 time with its offset (default: now)")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            data = json.loads(options["file"].read_text(), parse_float=Decimal)
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot read {options['file']}: {exc}") from None
        if not isinstance(data, dict):
            raise CommandError("not a LiteLLM price file: its top level is not an object")
        valid_from = _when(options["valid_from"])
        mapping = dict(_pair(m) for m in options["model"])  # LiteLLM name -> Sluice name
        created = skipped = 0
        for entry in pricing.from_litellm(data, list(mapping)):
            name = mapping.get(entry.name, entry.name)
            reason = entry.skipped or ("" if _NAME.match(name) else
                                       "not a Sluice model name (map it with --model)")
            if not reason and entry.fields is not None:
                try:
                    services.price_create(actor=None, model=name, valid_from=valid_from,
                                          **entry.fields)
                    created += 1
                    continue
                except ApiError as exc:
                    reason = exc.message
            skipped += 1
            if mapping:  # only the named entries' reasons: a whole file's are thousands
                self.stderr.write(f"{entry.name}: skipped: {reason}")
        self.stdout.write(f"{created} price versions from {valid_from.isoformat()}; "
                          f"{skipped} entries skipped")
        if mapping and created < len(mapping):
            raise CommandError(f"{len(mapping) - created} of the named models not imported")


def _pair(text: str) -> tuple[str, str]:
    sluice, sep, litellm = text.partition("=")
    if not sep or not sluice or not litellm:
        raise CommandError(f"--model {text!r}: write SLUICE=LITELLM")
    return litellm, sluice


def _when(text: str | None) -> datetime:
    if text is None:
        return timezone.now()
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise CommandError(f"--valid-from {text!r} is not an ISO 8601 time") from None
    if when.tzinfo is None:
        raise CommandError(f"--valid-from {text!r} has no offset (write ...Z or +00:00)")
    return when
