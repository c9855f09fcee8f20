"""`manage.py auditwriter`: move audit events from the Redis stream into the database
until SIGTERM/SIGINT (the run command starts one; more may run)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from governance.audit import Consumer


class Command(BaseCommand):
    help = "Write audit events from the Redis stream into the database."

    def handle(self, *args: Any, **options: Any) -> None:
        Consumer.run_process()
