"""The pinned agent CLIs (Codex CLI, Claude Code) from npm, and how to run one quietly.

    bins = install(cache_dir())          # npm install of both pinned packages, once
    env = quiet_env(home, base_url, key) # fresh HOME, no telemetry, no update checks
    done = run(argv, cwd=work, env=env, timeout=45)   # killed with its children on timeout

Used by the suite (tests/streaming/test_agent_clis.py, the `agent_cli` fixture), by
`./dev.sh test` (`python -m tests.streaming.agent_clis`, when Node is present) and by the
capture tool (tests/bench/capture_cli_requests.py). The cache folder is outside any git
checkout (Codex reports the enclosing repository's commit and state in its request
metadata) and outside /tmp (Codex refuses to install its helper binaries under a
temporary directory): `$XDG_CACHE_HOME/sluice-agent-clis`, else `~/.cache/...`.

No network beyond loopback without a namespace: every proxy variable points at a closed
loopback port, loopback excepted, and each CLI's telemetry, error reporting and update
checks are switched off through its own settings. A network namespace (`unshare -rn`)
isolates better but also hides a server on the host's loopback, so the capture tool
uses one (its recorder runs inside) and the suite does not.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CODEX_VERSION = "0.171.0"
CLAUDE_VERSION = "2.1.332"
# The CLI's command name -> (npm package, pinned version).
PACKAGES = {"codex": ("@openai/codex", CODEX_VERSION),
            "claude": ("@anthropic-ai/claude-code", CLAUDE_VERSION)}
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, a connect fails at once


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sluice-agent-clis"


def installed(prefix: Path, package: str) -> str | None:
    """The version of `package` installed under the npm `prefix`, None when absent."""
    manifest = prefix / "node_modules" / package / "package.json"
    if not manifest.exists():
        return None
    return str(json.loads(manifest.read_text()).get("version"))


def install(cache: Path) -> Path:
    """npm-installs both pinned packages under `cache/npm` unless they are there;
    returns the folder of their commands (`.bin`). Raises CalledProcessError when npm
    fails and FileNotFoundError without npm."""
    prefix = cache / "npm"
    bins = prefix / "node_modules" / ".bin"
    if all(installed(prefix, name) == version for name, version in PACKAGES.values()):
        return bins
    prefix.mkdir(parents=True, exist_ok=True)
    wanted = [f"{name}@{version}" for name, version in PACKAGES.values()]
    subprocess.run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                    "--no-save", *wanted], check=True)
    return bins


def quiet_env(home: Path, base_url: str, key: str, *, proxied: bool = True) -> dict[str, str]:
    """A CLI's whole environment: `home` as HOME (and every XDG folder under it), `key`
    as both CLIs' key (Codex reads `SLUICE_API_KEY` through its provider's `env_key`),
    `base_url` as Claude Code's ANTHROPIC_BASE_URL, no telemetry, no update checks;
    with `proxied`, every proxy variable at a closed port, loopback excepted."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "USER": "user", "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1",
           "CODEX_HOME": str(home / ".codex"), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_CACHE_HOME": str(home / ".cache"), "XDG_DATA_HOME": str(home / ".local/share"),
           "SLUICE_API_KEY": key,
           # Claude Code
           "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": key,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
           "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
           "DO_NOT_TRACK": "1", "CI": "1"}
    if proxied:
        env.update({"HTTPS_PROXY": CLOSED, "HTTP_PROXY": CLOSED, "ALL_PROXY": CLOSED,
                    "NO_PROXY": "127.0.0.1,localhost"})
    return env


def codex_config(base_url: str, provider: str = "sluice") -> str:
    """Codex's `config.toml`: `base_url` (ending in /v1) as its model provider over the
    Responses API, keyed by SLUICE_API_KEY, read-only sandbox, no approvals, no
    analytics, plugins or feedback, no retries (a refusal shows at once)."""
    return "\n".join([
        f'model_provider = "{provider}"',
        'approval_policy = "never"',
        'sandbox_mode = "read-only"',
        "check_for_update_on_startup = false",
        "",
        "[analytics]", "enabled = false", "",
        # The curated-plugins startup sync reaches api.github.com.
        "[features]", "plugins = false", "",
        "[feedback]", "enabled = false", "",
        f"[model_providers.{provider}]",
        f'name = "{provider}"',
        f'base_url = "{base_url}"',
        'env_key = "SLUICE_API_KEY"',
        'wire_api = "responses"',
        "request_max_retries = 0",
        "stream_max_retries = 0",
        "",
    ])


def netns_works() -> bool:
    """Whether `unshare -rn` can make a network namespace with loopback up here."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    probe = subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up"],
                           capture_output=True)
    return probe.returncode == 0


@dataclass
class Done:
    rc: int | None  # None: killed at the timeout
    stdout: str
    stderr: str


def run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> Done:
    """Runs a CLI to its end or to `timeout` seconds, then kills its whole process group
    (a CLI's helpers hold its pipes open: killing the CLI alone would leave the wait
    hanging on them)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return Done(proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Done(None, out, err)


def main() -> int:
    """`./dev.sh test`'s step: install the pinned CLIs when npm is present."""
    if shutil.which("npm") is None:
        print("sluice: no Node/npm: the agent CLI tests will be skipped", file=sys.stderr)
        return 0
    install(cache_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())
