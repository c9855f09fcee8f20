"""Create (or refresh) the demo tenant, its admin and a developer key; print them as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from django.core.management.base import BaseCommand

from tenants.services import demo_seed


class Command(BaseCommand):
    help = "Seed the demo tenant with an admin user and an API key (idempotent)."

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write(json.dumps(asdict(demo_seed())))
