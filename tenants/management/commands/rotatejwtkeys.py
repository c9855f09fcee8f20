"""Add a new JWT signing key (it signs from now on) and prune keys retired long enough."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from tenants.signing_keys import keyring


class Command(BaseCommand):
    help = "Rotate the platform's JWT signing key; prune keys no token can still need."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--prune-only", action="store_true",
                            help="Only remove retired keys; add none.")

    def handle(self, *args: Any, **options: Any) -> None:
        ring = keyring()
        if not options["prune_only"]:
            key = ring.rotate()
            self.stdout.write(f"active key: {key.kid} ({key.alg})")
        # A retired key may still verify tokens it signed until they expire.
        grace = timedelta(seconds=settings.SLUICE_JWT_ACCESS_TTL_S + settings.SLUICE_JWT_LEEWAY_S)
        for kid in ring.prune(grace=grace):
            self.stdout.write(f"pruned key: {kid}")
