"""The performance suite of the performance issue in one command: each benchmark in
turn on loopback, each against its baseline measured in the same run, then one table of
the headline figures against the goals.

    .venv/bin/python tests/bench/suite.py [--quick] [--skip rest,grpc,litellm,sse]

The benchmarks, each also runnable alone (their own output is passed through):

    rest     bench_http.py    governed REST vs a bare ASGI app, same server and processes
    grpc     bench_grpc.py    gRPC unary vs REST on the same pipeline
    litellm  bench_litellm.py the same governed load against LiteLLM proxy (installed
                              into its own virtualenv on first use)
    sse      bench_sse.py     10,000 concurrent streams vs a bare fan-out (3 rounds)

`--quick` runs each for a few seconds (SSE with 2,000 streams): a check that the suite
works, not figures. Needs wrk (Debian package `wrk`). Figures swing 15-100% between runs
on a shared VM: compare the ratios, and alternate runs for A/B (tests/bench/ab.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCHES: dict[str, tuple[list[str], list[str]]] = {  # name: (full run, --quick run)
    "rest": (["bench_http.py", "--seconds", "8"], ["bench_http.py", "--seconds", "3"]),
    "grpc": (["bench_grpc.py", "--seconds", "8"], ["bench_grpc.py", "--seconds", "3"]),
    "litellm": (["bench_litellm.py", "--seconds", "10"],
                ["bench_litellm.py", "--seconds", "3"]),
    "sse": (["bench_sse.py", "--streams", "10000", "--tokens", "10", "--rounds", "3"],
            ["bench_sse.py", "--streams", "2000", "--tokens", "5", "--ramp", "3"]),
}


def _row(figure: str, value: str, baseline: str, goal: str, met: bool | None) -> list[str]:
    return [figure, value, baseline, goal, "-" if met is None else ("yes" if met else "NO")]


def table(reports: dict[str, dict[str, Any]]) -> list[list[str]]:
    """The headline figures of the reports, each with its same-run baseline and goal."""
    rows = []
    rest = reports.get("rest")
    if rest:
        governed, bare = rest["governed"], rest["bare"]
        share = governed["rps"] / bare["rps"]
        rows.append(_row("REST governed, 64 connections", f"{governed['rps']:,.0f} req/s",
                         f"bare ASGI {bare['rps']:,.0f} ({share:.1%})",
                         ">= 3,250 req/s and >= 15%",
                         governed["rps"] >= 3250 and share >= 0.15))
        added = rest["governed_one"]["p50"] - rest["bare_one"]["p50"]
        rows.append(_row("REST added p50, 1 connection", f"{added:.2f} ms",
                         f"bare ASGI {rest['bare_one']['p50']:.2f} ms", "<= 2 ms",
                         added <= 2.0))
    grpc = reports.get("grpc")
    if grpc:
        ratio = grpc["grpc"]["rps"] / grpc["rest"]["rps"]
        rows.append(_row("gRPC unary vs REST", f"{ratio:.2f}x",
                         f"REST {grpc['rest']['rps']:,.0f} req/s", ">= 1.5x", ratio >= 1.5))
    litellm = reports.get("litellm")
    if litellm:
        results = litellm["results"]
        ours, theirs = results["Sluice, governed"], results["LiteLLM, limits in Redis"]
        ratio = ours["rps"] / theirs["rps"]
        rows.append(_row("vs LiteLLM (limits in Redis)",
                         f"{ratio:.1f}x, p99 {ours['p99']:.0f} ms",
                         f"LiteLLM {theirs['rps']:,.0f} req/s, p99 {theirs['p99']:.0f} ms",
                         ">= 3x at a lower p99",
                         ratio >= 3 and ours["p99"] < theirs["p99"]))
    sse = reports.get("sse")
    if sse:
        ours, floor = sse["results"]["Sluice"], sse["results"]["bare SSE fan-out"]
        failed = sse["failed"]
        own = sse["own_p99_ms"]
        added = statistics.median(own)
        rows.append(_row(f"SSE, {sse['streams']:,} streams: failed", str(failed),
                         f"bare {sum(floor['errors'].values())}", "0", failed == 0))
        rounds = f" (median of {len(own)})" if len(own) > 1 else ""
        rows.append(_row("SSE added p99 inter-token", f"{added:+.0f} ms{rounds}",
                         f"bare fan-out p99 {floor['added_p99_ms']:.0f} ms", "<= 50 ms",
                         added <= 50))
        rows.append(_row("SSE memory per stream", f"{ours['kb_per_stream']:.0f} KB",
                         f"bare {floor['kb_per_stream']:.0f} KB", "(reported)", None))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--skip", default="", help="benchmarks to leave out, e.g. litellm")
    args = parser.parse_args()
    skipped = {name.strip() for name in args.skip.split(",") if name.strip()}
    unknown = skipped - set(BENCHES)
    if unknown:
        sys.exit(f"unknown benchmark(s) {sorted(unknown)}; these exist: {sorted(BENCHES)}")
    with tempfile.TemporaryDirectory(prefix="sluice-suite-") as tmp:
        report = Path(tmp) / "report.jsonl"
        env = {**os.environ, "SLUICE_BENCH_REPORT": str(report)}
        failed = []
        for name, (full, quick) in BENCHES.items():
            if name in skipped:
                continue
            script, *options = quick if args.quick else full
            command = [sys.executable, str(HERE / script), *options]
            print(f"\n=== {name}: {' '.join(command[1:])}", flush=True)
            began = time.monotonic()
            code = subprocess.run(command, env=env, check=False).returncode
            print(f"=== {name}: exit {code} after {time.monotonic() - began:.0f} s",
                  flush=True)
            if code:
                failed.append(name)
        reports = {}
        if report.exists():
            for line in report.read_text().splitlines():
                entry = json.loads(line)
                reports[entry["bench"]] = entry
    rows = [["figure", "value", "baseline (same run)", "goal", "met"], *table(reports)]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    print("\nSummary" + (" (--quick: a smoke run, not figures)" if args.quick else ""))
    for row in rows:
        print("  ".join(cell.ljust(width)
                        for cell, width in zip(row, widths, strict=True)).rstrip())
    if failed:
        sys.exit(f"benchmark(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
