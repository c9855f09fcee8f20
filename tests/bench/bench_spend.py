"""Server time of the admin UI's spend page over 90 days x 1,000 keys of daily rollups
(issue #44's goal: under 300 ms), against the same page for a tenant with no rows,
measured in the same run.

A tenant gets `--days` x `--keys` daily rows (governance/rollup_models.py UsageDay; one
model, a latency histogram each, as the rollup writes them); its tenant admin, signed
in through a real session, asks for /ui/spend?days=90&group_by=key through Django's
test client (the whole middleware stack, the template rendered; no network) `--runs`
times after two warm-up runs; the same for an empty tenant's admin. Also timed: what
the spend API computes for group_by=key over the same range (governance/rollups.py
spend: a row per day and key), without and with latency percentiles (which read every
row's histogram). Printed: the median and the 90th percentile in ms, and the ratios to
the empty page.

On the run command's embedded SQLite in a temporary state dir unless --database-url
names an empty PostgreSQL database (migrated here, its rows left in place).

    .venv/bin/python tests/bench/bench_spend.py [--days 90] [--keys 1000] [--runs 15]
        [--database-url postgres://postgres@127.0.0.1:5432/bench_spend]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def timed(call: Callable[[], int], runs: int) -> list[float]:
    for _ in range(2):
        assert call() == 200
    out = []
    for _ in range(runs):
        began = time.perf_counter()
        assert call() == 200
        out.append((time.perf_counter() - began) * 1000)
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--days", type=int, default=90)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--database-url", default=None)
    args = parser.parse_args()
    os.environ.update(SLUICE_STATE_DIR=tempfile.mkdtemp(prefix="sluice-bench-"),
                      DJANGO_SETTINGS_MODULE="sluice.settings.base", SLUICE_LOG_LEVEL="ERROR")
    os.environ.pop("DATABASE_URL", None)
    if args.database_url:
        os.environ["DATABASE_URL"] = args.database_url
    sys.path[:0] = [str(REPO), str(REPO / "platform")]
    import django
    django.setup()
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client

    from frontend.session import SESSION_MEMBER
    from governance import rollups
    from governance.models import UsageDay
    from tenants.models import Member, Tenant
    from tenants.roles import Role

    settings.ALLOWED_HOSTS = ["*"]
    call_command("migrate", verbosity=0)
    stamp = int(time.time())

    def admin_of(slug: str) -> Client:
        tenant = Tenant.objects.create(slug=slug, name=slug)
        user = User.objects.create_user(username=f"{slug}-admin")
        member = Member.objects.create(tenant=tenant, user=user, role=Role.TENANT_ADMIN)
        client = Client()
        client.force_login(user)
        session = client.session
        session[SESSION_MEMBER] = member.pk
        session.save()
        return client

    full, empty = admin_of(f"full{stamp}"), admin_of(f"empty{stamp}")
    tenant = Tenant.objects.get(slug=f"full{stamp}")
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    began = time.perf_counter()
    for day in range(args.days):
        UsageDay.objects.bulk_create([UsageDay(
            start=today - timedelta(days=day), tenant=tenant, member_id=k % 50 + 1,
            key_prefix=f"k{k:07d}", model="smollm2", calls=100 + k % 7, errors=k % 3,
            prompt_tokens=5000 + k, completion_tokens=2000 + day, cost_nanousd=1_234_567 + k,
            latency_hist={"40": 50, "45": 40, "60": 10 + k % 5}) for k in range(args.keys)],
            batch_size=2000)
    print(f"{args.days * args.keys:,} daily rows written in "
          f"{time.perf_counter() - began:.1f} s ({connection.vendor})")
    page = f"/ui/spend?days={args.days}&group_by=key&granularity=day"
    now = datetime.now(UTC)

    def api(latency: bool) -> int:  # what GET /api/v1/governance/spend?group_by=key does
        rollups.spend(tenant_id=tenant.pk, granularity="day", group_by="key",
                      start=now - timedelta(days=args.days), stop=now, latency=latency)
        return 200
    base = timed(lambda: empty.get(page).status_code, args.runs)
    spend = timed(lambda: full.get(page).status_code, args.runs)
    plain = timed(lambda: api(False), max(3, args.runs // 3))
    heavy = timed(lambda: api(True), max(3, args.runs // 3))

    def line(name: str, ms: list[float]) -> str:
        p90 = ms[min(len(ms) - 1, int(len(ms) * 0.9))]
        return (f"{name:44} median {statistics.median(ms):8.1f} ms  p90 {p90:8.1f} ms  "
                f"{statistics.median(ms) / statistics.median(base):6.1f}x the empty page")
    print(line("spend page, no rows (baseline)", base))
    print(line(f"spend page, {args.days} days x {args.keys} keys", spend))
    print(line("spend API by key (a row a day and key)", plain))
    print(line("the same with latency percentiles", heavy))
    goal = statistics.median(spend) < 300
    print(f"goal (the spend page under 300 ms of server time): {'met' if goal else 'not met'}")


if __name__ == "__main__":
    main()
