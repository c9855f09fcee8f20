"""A transactional test's flush on PostgreSQL by DELETE instead of TRUNCATE.

pytest-django's `transactional_db` (every live-server test) ends with Django's flush,
whose PostgreSQL statement is one TRUNCATE of every table: ~0.13 s each time on the CI
machine, because TRUNCATE gives each table a new file, and then post_migrate recreates
every content type and permission (~0.1 s). A test's tables hold a few rows, which
DELETE removes in ~5 ms; content types and permissions are the same before and after
(post_migrate would write them back as they were), so they are kept. The end state is
what TRUNCATE leaves: every other table empty. With ~1,000 such tests a run, that is
about two minutes of the suite on two cores.

The audit table refuses DELETE (governance/migrations/0003_audit_append_only.py) unless
`sluice.audit_purge` is on for the transaction, as the retention purge sets it; the flush
sets it too. Foreign keys are Django's, deferred to the commit, so order does not
matter. A flush that resets sequences (a test asking for it) stays a TRUNCATE.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.postgresql.operations import DatabaseOperations

# post_migrate writes these back as they were: kept, so it finds them and writes nothing.
_KEPT = frozenset({"django_content_type", "auth_permission"})
_truncate = DatabaseOperations.sql_flush


def _delete(self: DatabaseOperations, style: Any, tables: list[str], *,
            reset_sequences: bool = False, allow_cascade: bool = False) -> list[str]:
    if reset_sequences or not tables:
        return _truncate(self, style, tables, reset_sequences=reset_sequences,
                         allow_cascade=allow_cascade)
    return ["SET LOCAL sluice.audit_purge = 'on'",
            # the names are the introspected tables, quoted
            *(f"DELETE FROM {self.quote_name(t)}" for t in tables if t not in _KEPT)]  # noqa: S608


def install() -> None:
    DatabaseOperations.sql_flush = _delete  # type: ignore[method-assign]
