"""Run one inference worker for a registered deployment (until SIGTERM; then drains)."""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from inference.models import Deployment
from inference.worker import serve


class Command(BaseCommand):
    help = "Serve a deployment's Redis queue with a model worker."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--deployment", required=True)
        parser.add_argument("--reclaim-after-ms", type=int, default=None,
                            help="Take over entries of workers silent this long.")

    def handle(self, *args: Any, **options: Any) -> None:
        deployment = Deployment.objects.filter(name=options["deployment"]).first()
        if deployment is None:
            raise CommandError(f"no deployment named {options['deployment']!r}")
        logging.basicConfig(level=str(settings.LOGGING["root"]["level"]),  # type: ignore[index]
                            format="%(asctime)s %(levelname)s %(name)s %(message)s")
        serve(deployment.to_spec(), settings.REDIS_URL,
              reclaim_after_ms=options["reclaim_after_ms"])
