"""What an operator does to the cluster through Django, as a process of its own (the
multi-node test's own process is bound to pytest-django's database, not the cluster's):

    python -m tests.cluster.ops seed [--echo-delay-ms N] [--batch N]
                                                 migrate, create the deployment and the
                                                 tenants; prints their keys as JSON
    python -m tests.cluster.ops report           after the load: the audit chains
                                                 verified, each tenant's chat calls as
                                                 audited, its quota and usage counters

DATABASE_URL and REDIS_URL name the cluster's PostgreSQL and Redis.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

MODEL = "echo-mn"
FAULT, LIMITED = "fault", "limited"  # the tenants: one under faults, one rate-limited
LIMIT_PER_MINUTE = 60  # the limited tenant's requests per minute across all gateways
LIMIT_BURST = 5
ECHO_TOKEN_DELAY_MS = 25  # a call of ~30 tokens takes ~0.75 s: faults find calls in flight


def _setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sluice.settings.test")
    import django

    django.setup()


def seed(echo_delay_ms: float = ECHO_TOKEN_DELAY_MS, batch: int = 16) -> dict[str, Any]:
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from governance.models import Quota, RateLimitPolicy, RateLimitScope
    from inference.models import Deployment
    from tenants.models import Member, Tenant
    from tenants.principal import AuthMethod, Principal
    from tenants.roles import Role
    from tenants.services import apikey_create

    call_command("migrate", verbosity=0)
    deployment = Deployment.objects.create(
        name=MODEL, runtime="echo", max_batch_size=batch, echo_token_delay_ms=echo_delay_ms,
        max_queue_depth=4096, tenant_queue_share=1.0, max_deliveries=20)
    keys = {}
    for slug in (FAULT, LIMITED):
        tenant = Tenant.objects.create(slug=slug, name=f"{slug.title()} Inc")
        user = get_user_model().objects.create_user(username=f"{slug}-dev",
                                                    email=f"dev@{slug}.example")
        member = Member.objects.create(tenant=tenant, user=user, role=Role.DEVELOPER)
        actor = Principal(tenant_id=tenant.pk, tenant_slug=slug, role=Role.DEVELOPER,
                          subject=member.subject, method=AuthMethod.SESSION,
                          member_id=member.pk)
        keys[slug] = apikey_create(actor=actor, name="load", role=Role.DEVELOPER).secret
        Quota.objects.create(tenant=tenant, max_tokens=10**12)  # counts, never refuses
        if slug == LIMITED:
            # fail_open False: a limit that must hold even while Redis is unreachable.
            RateLimitPolicy.objects.create(
                scope=RateLimitScope.TENANT, tenant=tenant,
                requests_per_minute=LIMIT_PER_MINUTE, burst_requests=LIMIT_BURST,
                fail_open=False)
    return {"spec": deployment.to_spec().to_json(), "keys": keys, "model": MODEL,
            "limit_per_minute": LIMIT_PER_MINUTE, "burst": LIMIT_BURST}


def report() -> dict[str, Any]:
    from governance import audit, usage
    from governance import quota as quotas
    from governance.models import AuditEvent, Quota, UsageRecord
    from inference import queue as q
    from sluice.redis import sync_redis

    rds = sync_redis()
    out: dict[str, Any] = {
        "audit_problems": [f"{p.chain}#{p.seq}: {p.reason}" for p in audit.verify()],
        "audit_events": AuditEvent.objects.count(),
        "usage_rows": usage.rollup(),
        "tenants": {},
    }
    for slug in (FAULT, LIMITED):
        calls = []
        for event in (AuditEvent.objects.filter(chain=slug, action="chat.completions")
                      .order_by("seq")):
            finals = None
            if event.request_id:  # how many final events its request's stream holds
                finals = sum(1 for _id, fields in rds.xrange(q.out_key(slug, event.request_id))
                             if b'"t":"done"' in fields[b"e"] or b'"t":"error"' in fields[b"e"])
            calls.append({"rid": event.request_id, "status": event.status,
                          "finish": (event.detail or {}).get("finish"),
                          "tokens": event.prompt_tokens + event.completion_tokens,
                          "excerpt": event.request_excerpt[:60], "finals": finals})
        [quota] = Quota.objects.filter(tenant__slug=slug)
        peek = rds.eval(quotas.PEEK_LUA, 3, *quotas.keys_for(slug, [quota]),
                        *quotas.peek_args([quota]))
        used = quotas.QuotaUse.from_reply(peek[0])
        records = UsageRecord.objects.filter(tenant__slug=slug)
        out["tenants"][slug] = {
            "calls": calls,
            "quota": {"requests": used.requests, "tokens": used.tokens,
                      "open_reservations": used.open_reservations},
            "usage": {"requests": sum(r.requests for r in records),
                      "tokens": sum(r.prompt_tokens + r.completion_tokens for r in records)},
        }
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["seed", "report"])
    parser.add_argument("--echo-delay-ms", type=float, default=ECHO_TOKEN_DELAY_MS)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    _setup()
    result = seed(args.echo_delay_ms, args.batch) if args.what == "seed" else report()
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
