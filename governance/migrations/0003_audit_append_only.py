"""PostgreSQL refuses UPDATE and DELETE on audit events, except the retention purge's
DELETE (it sets `sluice.audit_purge` for its transaction). SQLite (the zero-setup
default) relies on the code paths alone."""

from django.db import migrations

FUNCTION = """
CREATE OR REPLACE FUNCTION sluice_audit_append_only() RETURNS trigger AS $$
BEGIN
  IF TG_OP = 'DELETE' AND current_setting('sluice.audit_purge', true) = 'on' THEN
    RETURN OLD;
  END IF;
  RAISE EXCEPTION 'audit events are append-only';
END $$ LANGUAGE plpgsql;
CREATE TRIGGER audit_append_only BEFORE UPDATE OR DELETE ON governance_auditevent
  FOR EACH ROW EXECUTE FUNCTION sluice_audit_append_only();
"""
DROP = """
DROP TRIGGER IF EXISTS audit_append_only ON governance_auditevent;
DROP FUNCTION IF EXISTS sluice_audit_append_only();
"""


def forward(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FUNCTION)


def backward(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("governance", "0002_audit")]
    operations = [migrations.RunPython(forward, backward)]
