"""The settlement's Redis time per call (issue #32): this checkout's quota.SETTLE_LUA
against another revision's, on the Redis at REDIS_URL (keys under the tenant
"bench-settle", deleted at the end).

A flush of N calls of one tenant with one quota: each call reserved first (untimed),
then the timed part, what the recorder sends for them: this revision's one SETTLE_LUA
call (quota charge, usage counts and settled marks together); the other revision's as
its recorder sent it (read from `git show REV:governance/quota.py`): its SETTLE_LUA and,
before 38b02f6, usage.COUNT_LUA for the same calls. --rounds alternated rounds of 15
flushes each; the median per flush and per call of each round.

    .venv/bin/python tests/bench/bench_settle.py [--rev 38b02f6~1] [--calls 500]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform")]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sluice.settings.base")
TENANT = "bench-settle"


def _module_at(rev: str, path: str) -> Any:
    """The module `path` as it is at `rev`, imported under a name of its own."""
    source = subprocess.check_output(["git", "show", f"{rev}:{path}"], cwd=REPO)
    folder = Path(tempfile.mkdtemp(prefix="bench-settle-"))
    (folder / "old_quota.py").write_bytes(source)
    spec = importlib.util.spec_from_file_location("old_quota", folder / "old_quota.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_quota"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rev", default="38b02f6~1")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import django
    django.setup()
    from django.conf import settings

    from governance import quota as new
    from governance import usage
    from governance.models import Quota
    from sluice.redis import sync_client

    old = _module_at(args.rev, "governance/quota.py")
    rds = sync_client(settings.REDIS_URL)
    row = Quota(period="day", max_tokens=10**12)
    row.pk = 99
    n = args.calls

    def reserve(module: Any, rids: list[str]) -> list[str]:
        keys = module.keys_for(TENANT, [row])
        for rid in rids:
            rds.eval(module.RESERVE_LUA, 3, *keys, *module.reserve_args(rid, 60, [row], 100))
        return keys

    def before(flush: int) -> float:
        rids = [f"o{flush}-{i}" for i in range(n)]
        keys = reserve(old, rids)
        began = time.perf_counter()
        if hasattr(old, "settle_args"):  # before 38b02f6: settle, then count usage
            rds.eval(old.SETTLE_LUA, 3, *keys,
                     *old.settle_args([row], [(rid, 1, 30) for rid in rids]))
            ckeys, cargs = usage.once_per_flush(
                [usage.usage_key(TENANT, "d")],
                [3600, "m|k|r", n, "m|k|p", 10 * n, "m|k|c", 20 * n],
                mark=usage.applied_key(TENANT, "bench"), flush=flush)
            rds.eval(usage.COUNT_LUA, len(ckeys), *ckeys, *cargs)
        else:
            skeys, sargs = old.settle_call(TENANT, [row], [
                old.Settlement(rid, rid, 1, 10, 20, "m|k|") for rid in rids])
            rds.eval(old.SETTLE_LUA, len(skeys), *skeys, *sargs)
        return time.perf_counter() - began

    def after(flush: int) -> float:
        rids = [f"n{flush}-{i}" for i in range(n)]
        reserve(new, rids)
        began = time.perf_counter()
        skeys, sargs = new.settle_call(TENANT, [row], [
            new.Settlement(rid, rid, 1, 10, 20, "m|k|") for rid in rids])
        rds.eval(new.SETTLE_LUA, len(skeys), *skeys, *sargs)
        return time.perf_counter() - began

    flushes = iter(range(10**9))
    try:
        for _round in range(args.rounds):
            for name, flush in ((args.rev, before), ("this checkout", after)):
                took = statistics.median(flush(next(flushes)) for _ in range(15))
                print(f"{name}: {n} calls a flush, median {took * 1000:.2f} ms a flush, "
                      f"{took / n * 1e6:.1f} us a call")
    finally:
        for key in rds.scan_iter(f"sluice:{{{TENANT}}}:*"):
            rds.delete(key)
        rds.close()


if __name__ == "__main__":
    main()
