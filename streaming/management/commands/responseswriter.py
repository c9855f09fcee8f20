"""`manage.py responseswriter`: move stored responses from the Redis stream into the
database until SIGTERM/SIGINT (streaming/apis/responses/writer.py; several may run)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from streaming.apis.responses.writer import Writer


class Command(BaseCommand):
    help = "Write stored responses from the Redis stream into the database."

    def handle(self, *args: Any, **options: Any) -> None:
        Writer.run_process()
