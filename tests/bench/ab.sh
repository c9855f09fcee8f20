#!/usr/bin/env bash
# Alternating A/B runs of a benchmark: REV's version of PATHS ("before"), then the
# checkout's ("after"), ROUNDS times. These VMs change speed by 2-3x within minutes, so
# only alternating runs compare. PATHS must be committed (nothing uncommitted there is
# touched: the script refuses), and they are restored even if a run fails.
#
#   tests/bench/ab.sh REV ROUNDS "PATH..." BENCH [ARGS...]
#   e.g. tests/bench/ab.sh 38a675e 3 "governance inference" tests/bench/bench_cpu.py --seconds 10
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=$1 rounds=$2 paths=$3
shift 3
read -r -a targets <<< "$paths"
if [ -n "$(git status --porcelain -- "${targets[@]}")" ]; then
  echo "ab.sh: uncommitted changes under $paths; commit or stash them first" >&2
  exit 2
fi
trap 'git checkout -q HEAD -- "${targets[@]}"' EXIT
for round in $(seq "$rounds"); do
  for side in before after; do
    if [ "$side" = before ]; then git checkout -q "$rev" -- "${targets[@]}"; fi
    echo "== $side ($([ "$side" = before ] && echo "$rev" || git rev-parse --short HEAD)), round $round"
    .venv/bin/python "$@" || echo "ab.sh: the run failed (rc $?)"
    git checkout -q HEAD -- "${targets[@]}"
  done
done
