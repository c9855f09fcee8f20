"""Run the autoscaler: worker processes per deployment that follow demand (see
inference/autoscaler.py). Stops its workers (drained) on SIGTERM/SIGINT."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from inference.autoscaler import HUNG_AFTER_S, Autoscaler
from inference.supervisor import preload
from sluice.observability import telemetry
from sluice.processes import set_on_signals
from sluice.redis import sync_client


class Command(BaseCommand):
    help = "Scale inference workers with demand (local processes, or decisions only)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--driver", choices=("local", "none"), default="local",
                            help="local: run workers as child processes; none: decide and "
                                 "publish only (Kubernetes/KEDA scales the workers).")
        parser.add_argument("--deployment", action="append", default=[],
                            help="Only these deployments (repeatable); default: all enabled.")
        parser.add_argument("--tick", type=float, default=0.2, help="Seconds between looks.")
        parser.add_argument("--hung-after", type=float, default=HUNG_AFTER_S,
                            help="Kill and replace a ready worker silent this many seconds "
                                 "(no heartbeat: wedged).")

    def handle(self, *args: Any, **options: Any) -> None:
        telemetry.setup("sluice-autoscaler")
        if options["driver"] == "local":
            preload()  # forked workers inherit the imports: cold starts skip them
        client = sync_client(settings.REDIS_URL, socket_timeout=10, socket_connect_timeout=5)
        scaler = Autoscaler(client, settings.REDIS_URL, driver=options["driver"],
                            only=options["deployment"], tick_s=options["tick"],
                            hung_after_s=options["hung_after"])
        set_on_signals(scaler.stopping)
        scaler.run()
