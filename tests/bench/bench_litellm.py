"""Sluice against LiteLLM proxy on the same box, same run, same wrk load.

LiteLLM proxy (pip `litellm[proxy]`) is installed by this script into its own virtualenv
(var/bench/litellm-venv, or --venv; never a project dependency) and run in front of
`mock_openai.py`, a bare ASGI upstream that answers like Sluice's echo deployment. Each
LiteLLM caller is a key with request and token rate limits (`rpm_limit`, `tpm_limit`,
enforced by LiteLLM's own rate-limit hooks) and the deployment has its own rpm/tpm.
LiteLLM runs three ways: one worker with limits counted in process memory, one worker
with limits counted in Redis (what more than one LiteLLM instance needs; Sluice always
counts in Redis), and two workers with Redis. The keys: LiteLLM's virtual keys live in
PostgreSQL through Prisma, whose engine binaries are downloaded from binaries.prisma.sh,
a host this build machine cannot reach; so the keys are served by LiteLLM's documented
`custom_auth` hook, returning the same `UserAPIKeyAuth` object (key, models, limits) a
cached virtual key resolves to, with `custom_auth_run_common_checks` on. That is
LiteLLM's hot path for a cached key without its database writes (spend tracking), so if
anything it flatters LiteLLM. A short check proves the limits are live: a key with
rpm_limit 3 gets 429 on its 4th request.

Sluice runs governed, as in bench_http.py (API key, tenant and per-model rate limits, a
token quota, breaker, enqueue on Redis, the echo worker, audit writer) with one gateway
process, then two.

    .venv/bin/python tests/bench/bench_litellm.py [--connections 64] [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform"), str(REPO / "tests" / "bench")]

import redis  # noqa: E402
from bench_http import (  # noqa: E402
    FRONT,
    WRK_LUA,
    bench_env,
    govern_demo,
    report,
    seed_demo,
    start_sluice,
    wait_http,
    wrk,
    wrk_args,
)

from sluice.localinfra import free_port  # noqa: E402
from sluice.processes import ProcessGroup  # noqa: E402
from sluice.servers import http_command  # noqa: E402

BENCH_DIR = REPO / "tests" / "bench"
BENCH_KEY = "sk-bench-litellm-0001"
LIMITED_KEY = "sk-bench-litellm-rpm3"

# LiteLLM's custom_auth hook: the keys and the limits a virtual key would carry.
AUTH_MODULE = '''
from fastapi import Request
from litellm.proxy._types import UserAPIKeyAuth

KEYS = {
    %(bench)r: {"rpm_limit": 10**8, "tpm_limit": 10**10},
    %(limited)r: {"rpm_limit": 3, "tpm_limit": 10**10},
}


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    limits = KEYS.get(api_key.removeprefix("Bearer ").strip())
    if limits is None:
        raise Exception("invalid API key")
    return UserAPIKeyAuth(api_key=api_key, token=api_key, key_alias=api_key[-4:],
                          models=["echo"], **limits)
'''

CONFIG = """
model_list:
  - model_name: echo
    litellm_params:
      model: openai/echo
      api_base: http://127.0.0.1:%(upstream)d/v1
      api_key: mock-upstream
      rpm: 100000000
      tpm: 10000000000
general_settings:
  master_key: sk-bench-master
  custom_auth: litellm_keys.user_api_key_auth
  custom_auth_run_common_checks: true
  disable_spend_logs: true
litellm_settings:
  drop_params: true
  telemetry: false
%(redis)s
"""

REDIS_SETTINGS = """
router_settings:
  redis_url: %s
"""


def ensure_litellm(venv: Path, spec: str) -> str:
    """LiteLLM proxy's version in `venv`, installing `spec` there first if missing."""
    py = venv / "bin" / "python"
    if not (venv / "bin" / "litellm").exists():
        print(f"installing {spec} into {venv} (own virtualenv, not a project dependency)",
              flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", spec], check=True)
    return subprocess.run([str(py), "-c", "from importlib.metadata import version; "
                           "print(version('litellm'))"], capture_output=True, text=True,
                          check=True).stdout.strip()


def post(url: str, key: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def start_litellm(group: ProcessGroup, venv: Path, workdir: Path, port: int,
                  upstream: int, redis_url: str | None, workers: int, log: Path) -> None:
    config = workdir / f"litellm-{workers}-{'redis' if redis_url else 'memory'}.yaml"
    config.write_text(CONFIG % {"upstream": upstream,
                                "redis": REDIS_SETTINGS % redis_url if redis_url else ""})
    group.start("litellm", [str(venv / "bin" / "litellm"), "--config", str(config),
                            "--host", "127.0.0.1", "--port", str(port),
                            "--num_workers", str(workers)], output=log)
    wait_http(f"http://127.0.0.1:{port}/health/liveliness", timeout=180)


def main() -> None:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--venv", type=Path,
                            default=REPO / "var" / "bench" / "litellm-venv")
        parser.add_argument("--litellm", default="litellm[proxy]",
                            help="pip requirement for LiteLLM (pin a version to compare "
                                 "like with like across runs)")

    args = wrk_args(__doc__ or "", extra=options)  # --server: Sluice's and the upstream's
    version = ensure_litellm(args.venv, args.litellm)
    env, state, private = bench_env()
    work = Path(state)
    (work / "litellm_keys.py").write_text(
        textwrap.dedent(AUTH_MODULE % {"bench": BENCH_KEY, "limited": LIMITED_KEY}))
    # LiteLLM reads REDIS_URL from the environment too: only the config names its Redis.
    lite_env = {name: value for name, value in env.items() if name != "REDIS_URL"}
    lite_env.update({"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
                     "PYTHONPATH": str(work), "LITELLM_TELEMETRY": "False",
                     "DISABLE_SCHEMA_UPDATE": "True"})
    results: dict[str, dict[str, float]] = {}
    checks: dict[str, list[int]] = {}
    group = ProcessGroup(env)
    try:
        upstream = free_port()
        group.start("upstream", http_command(args.server, "mock_openai:app",
                                             host="127.0.0.1", port=upstream,
                                             app_dir=str(BENCH_DIR)))
        body = json.dumps({"model": "echo", "messages": [
            {"role": "user", "content": "hello"}]}).encode()
        direct = work / "direct.lua"
        direct.write_text(WRK_LUA % "none")
        wait_http(f"http://127.0.0.1:{upstream}/", timeout=30)
        results["mock upstream alone"] = wrk(
            f"http://127.0.0.1:{upstream}/v1/chat/completions", args.connections,
            args.seconds, str(direct))
        script = work / "litellm.lua"
        script.write_text(WRK_LUA % BENCH_KEY)
        variants = (("LiteLLM, limits in memory", None, 1),
                    ("LiteLLM, limits in Redis", env["REDIS_URL"], 1),
                    ("LiteLLM, Redis, 2 workers", env["REDIS_URL"], 2))
        for label, redis_url, workers in variants:
            lite = ProcessGroup(lite_env)
            port = free_port()
            redis.Redis.from_url(env["REDIS_URL"]).flushdb()  # no counts from the last one
            try:
                start_litellm(lite, args.venv, work, port, upstream, redis_url, workers,
                              work / "litellm.log")
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                checks[label] = [post(url, LIMITED_KEY, body) for _ in range(5)]
                wrk(url, 8, 2, str(script))  # warm-up
                results[label] = wrk(url, args.connections, args.seconds, str(script))
            finally:
                lite.stop()
        group.stop()  # the upstream's core goes back to Sluice
        group = ProcessGroup(env)
        key = seed_demo(env)
        govern_demo(env)
        sluice_port = free_port()
        start_sluice(group, http_command(args.server, "sluice.root.asgi:application",
                                         host="127.0.0.1", port=sluice_port))
        wait_http(f"http://127.0.0.1:{sluice_port}/healthz")
        sluice_script = work / "sluice.lua"
        sluice_script.write_text(WRK_LUA % key)
        url = f"http://127.0.0.1:{sluice_port}/v1/chat/completions"
        wrk(url, 8, 2, str(sluice_script))
        results["Sluice, governed"] = wrk(url, args.connections, args.seconds,
                                          str(sluice_script))
        group.stop(first=FRONT)  # calls wrk left in flight finish on the running worker
        group = ProcessGroup(env)
        start_sluice(group, http_command(args.server, "sluice.root.asgi:application",
                                         host="127.0.0.1", port=sluice_port, workers=2))
        wait_http(f"http://127.0.0.1:{sluice_port}/healthz")
        wrk(url, 8, 2, str(sluice_script))
        results["Sluice, governed, 2 gateways"] = wrk(url, args.connections, args.seconds,
                                                      str(sluice_script))
    except Exception:
        log = work / "litellm.log"
        if log.exists():
            print(log.read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        group.stop(first=FRONT)
        if private:
            private.stop()
        shutil.rmtree(state, ignore_errors=True)
    print(json.dumps({"litellm": version, "server": args.server, "connections": args.connections,
                      "seconds": args.seconds}))
    for label, statuses in checks.items():
        print(f"{label}: a key with rpm_limit 3, 5 requests -> {statuses}")
    print(f"{'server':30} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'non-2xx':>8}")
    for label, r in results.items():
        print(f"{label:30} {r['rps']:9.0f} {r['p50']:8.2f} {r['p99']:8.2f} "
              f"{r['errors']:8.0f}")
    for ours, theirs in (("Sluice, governed", "LiteLLM, limits in memory"),
                         ("Sluice, governed", "LiteLLM, limits in Redis"),
                         ("Sluice, governed, 2 gateways", "LiteLLM, Redis, 2 workers")):
        a, b = results[ours], results[theirs]
        print(f"{ours} / {theirs}: {a['rps'] / b['rps']:.2f}x req/s, "
              f"p99 {a['p99']:.1f} vs {b['p99']:.1f} ms")
    report("litellm", version=version, results=results)


if __name__ == "__main__":
    main()
