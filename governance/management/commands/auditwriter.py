"""`manage.py auditwriter`: move audit events from the Redis stream into the database
until SIGTERM/SIGINT (the run command starts one; more may run)."""

from __future__ import annotations

import threading
from typing import Any

from django.core.management.base import BaseCommand

from governance.audit import Consumer
from sluice import gctuning
from sluice.processes import set_on_signals


class Command(BaseCommand):
    help = "Write audit events from the Redis stream into the database."

    def handle(self, *args: Any, **options: Any) -> None:
        stop = threading.Event()
        set_on_signals(stop)
        consumer = Consumer()
        gctuning.tune()  # what start-up made lives as long as the process
        consumer.serve(stop)
