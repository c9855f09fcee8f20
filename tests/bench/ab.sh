#!/usr/bin/env bash
# Alternating A/B runs of a benchmark: REV's version of PATHS ("before"), then HEAD's
# ("after"), ROUNDS times. These VMs change speed by 2-3x within minutes, so only
# alternating runs compare. It runs in a temporary git worktree of HEAD (removed at the
# end), so the checkout itself is never touched: others working in it meanwhile never
# see REV's files. PATHS must be committed (the script refuses uncommitted changes there:
# they would not be measured).
#
#   tests/bench/ab.sh REV ROUNDS "PATH..." BENCH [ARGS...]
#   e.g. tests/bench/ab.sh 38a675e 3 "governance inference" tests/bench/bench_cpu.py --seconds 10
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=$1 rounds=$2 paths=$3
shift 3
read -r -a targets <<< "$paths"
if [ -n "$(git status --porcelain -- "${targets[@]}")" ]; then
  echo "ab.sh: uncommitted changes under $paths; commit them first" >&2
  exit 2
fi
tree=$(mktemp -d /tmp/ab.XXXXXX)
git worktree add -q --detach "$tree" HEAD
trap 'git worktree remove --force "$tree"' EXIT
ln -s "$PWD/.venv" "$tree/.venv"
cd "$tree"
for round in $(seq "$rounds"); do
  for side in before after; do
    if [ "$side" = before ]; then git checkout -q "$rev" -- "${targets[@]}"; fi
    echo "== $side ($([ "$side" = before ] && echo "$rev" || git rev-parse --short HEAD)), round $round"
    .venv/bin/python "$@" || echo "ab.sh: the run failed (rc $?)"
    # Back to HEAD. (A file HEAD has and REV lacks stays during "before": REV's code
    # does not import it.)
    git checkout -q HEAD -- "${targets[@]}"
  done
done
