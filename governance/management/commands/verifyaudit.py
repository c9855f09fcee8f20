"""`manage.py verifyaudit [--chain TENANT]`: recompute the audit hash chains; exit 1 and
name the first bad event of each broken chain."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from governance.audit import verify
from governance.models import AuditChain, AuditEvent


class Command(BaseCommand):
    help = "Verify the audit log's hash chains."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--chain", help="only this chain (a tenant slug, or 'platform')")

    def handle(self, *args: Any, chain: str | None = None, **options: Any) -> None:
        problems = verify(chain)
        chains = AuditChain.objects.count() if chain is None else 1
        events = AuditEvent.objects.count() if chain is None else AuditEvent.objects.filter(
            chain=chain).count()
        for p in problems:
            self.stderr.write(f"chain {p.chain}: event seq {p.seq} (id {p.event_id}): "
                              f"{p.reason}")
        if problems:
            raise CommandError(f"{len(problems)} of {chains} chains failed verification")
        self.stdout.write(f"ok: {chains} chains, {events} events verified")
