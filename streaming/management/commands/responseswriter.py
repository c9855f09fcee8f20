"""`manage.py responseswriter`: move stored responses from the Redis stream into the
database until SIGTERM/SIGINT (streaming/responses_writer.py; several may run)."""

from __future__ import annotations

import threading
from typing import Any

from django.core.management.base import BaseCommand

from sluice import gctuning
from sluice.processes import set_on_signals
from streaming.responses_writer import Writer


class Command(BaseCommand):
    help = "Write stored responses from the Redis stream into the database."

    def handle(self, *args: Any, **options: Any) -> None:
        stop = threading.Event()
        set_on_signals(stop)
        writer = Writer()
        gctuning.tune()  # what start-up made lives as long as the process
        writer.serve(stop)
