"""Capture the first model request of the pinned agent CLIs into test fixtures.

Installs ``@openai/codex`` and ``@anthropic-ai/claude-code`` at the pinned versions into a
cache folder (tests/streaming/agent_clis.py: npm, no global install), then runs each CLI
once, non-interactively, in a fresh HOME and working directory, with no permission to run
commands, against a loopback recorder that answers every model call with a minimal valid
streamed reply (Responses API SSE for Codex, Anthropic Messages SSE for Claude Code) so
the CLI exits cleanly.

Writes ``tests/streaming/fixtures/<cli>_<version>_first_request.json``: the first model
request (method, path, the headers that matter, JSON body) and the list of every request
the CLI sent during the run. Secrets never reach a fixture: authorization, API-key and
cookie headers are dropped (their names are listed), the run's key is scrubbed from the
body, and the run's temporary paths are replaced by stable placeholders.

The CLIs get no network beyond loopback: where ``unshare -rn`` works (Linux with user
namespaces) the capture runs in a network namespace that holds only ``lo``; otherwise an
unreachable proxy is set and telemetry and update checks are switched off through each
CLI's own settings (they are switched off in both cases). ``--strace`` lists every
``connect()`` the CLIs attempted, to see what they would have reached.

    .venv/bin/python tests/bench/capture_cli_requests.py            # both CLIs
    .venv/bin/python tests/bench/capture_cli_requests.py --only codex --strace
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from tests.streaming.agent_clis import (  # noqa: E402
    CLAUDE_VERSION,
    CODEX_VERSION,
    PACKAGES,
    cache_dir,
    codex_config,
    install,
    netns_works,
    quiet_env,
)

FIXTURES = {"codex": f"codex_{CODEX_VERSION}_first_request.json",
            "claude": f"claude_code_{CLAUDE_VERSION}_first_request.json"}
FAKE_KEY = "sk-capture-not-a-real-key-0123456789"
PROMPT = "Say hello"
# Header values kept in a fixture; every other header is listed by name only (session
# ids change per run, secrets must never be written).
KEPT_HEADERS = ("anthropic-version", "anthropic-beta", "anthropic-dangerous-direct-browser-access",
                "openai-beta", "user-agent", "originator", "version", "content-type",
                "accept", "x-app", "x-stainless-lang", "x-stainless-package-version",
                "x-stainless-runtime", "x-stainless-helper-method",
                "x-codex-beta-features", "x-openai-internal-codex-responses-lite")
SECRET_HEADERS = ("authorization", "x-api-key", "cookie", "proxy-authorization",
                  "chatgpt-account-id")


class Recorder:
    """Every request the CLI sent, in order, with secrets already removed."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.requests.append(entry)


def _sse(events: list[tuple[str, dict[str, Any]]]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                    for name, data in events)


def responses_stream(model: str) -> bytes:
    """A complete Responses API stream saying "Hello." (what Codex needs to finish a turn)."""
    message = {"type": "message", "id": "msg_capture", "role": "assistant",
               "status": "completed",
               "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]}
    usage = {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": 3}
    base = {"id": "resp_capture", "object": "response", "created_at": int(time.time()),
            "model": model}
    partial = {**message, "status": "in_progress", "content": []}
    return _sse([
        ("response.created", {"type": "response.created", "sequence_number": 0,
                              "response": {**base, "status": "in_progress", "output": []}}),
        ("response.output_item.added", {"type": "response.output_item.added",
                                        "sequence_number": 1, "output_index": 0,
                                        "item": partial}),
        ("response.output_text.delta", {"type": "response.output_text.delta",
                                        "sequence_number": 2, "item_id": "msg_capture",
                                        "output_index": 0, "content_index": 0,
                                        "delta": "Hello."}),
        ("response.output_item.done", {"type": "response.output_item.done",
                                       "sequence_number": 3, "output_index": 0,
                                       "item": message}),
        ("response.completed", {"type": "response.completed", "sequence_number": 4,
                                "response": {**base, "status": "completed",
                                             "output": [message], "usage": usage}}),
    ])


def messages_stream(model: str) -> bytes:
    """A complete Anthropic Messages stream saying "Hello."."""
    start: dict[str, Any] = {
        "id": "msg_capture", "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 1}}
    return _sse([
        ("message_start", {"type": "message_start", "message": start}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "Hello."}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": 2}}),
        ("message_stop", {"type": "message_stop"}),
    ])


def message_json(model: str) -> dict[str, Any]:
    return {"id": "msg_capture", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": "Hello."}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 2}}


def make_handler(recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _record(self, body: bytes) -> dict[str, Any]:
            headers: dict[str, str] = {}
            for name, value in self.headers.items():
                headers[name.lower()] = value
            parsed: Any = None
            if body:
                try:
                    parsed = json.loads(body)
                except ValueError:
                    parsed = {"_raw_bytes": len(body)}
            entry = {"method": self.command, "path": self.path, "headers": headers,
                     "body": parsed, "at": time.time()}
            recorder.add(entry)
            return entry

        def _send(self, status: int, payload: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(payload)))
            self.send_header("x-request-id", "req_capture")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _json(self, status: int, obj: Any) -> None:
            self._send(status, json.dumps(obj).encode(), "application/json")

        def do_HEAD(self) -> None:
            self._record(b"")
            self._send(200, b"", "text/plain")

        def do_GET(self) -> None:
            self._record(b"")
            if self.path.split("?")[0].endswith("/models"):
                self._json(200, {"object": "list", "data": [], "models": [],
                                 "has_more": False})
            else:
                self._json(404, {"error": {"message": "not found", "type": "not_found"}})

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            entry = self._record(self.rfile.read(length))
            body = entry["body"] if isinstance(entry["body"], dict) else {}
            model = str(body.get("model", "capture"))
            path = self.path.split("?")[0]
            if path.endswith("/responses"):
                self._send(200, responses_stream(model), "text/event-stream")
            elif path.endswith("/messages/count_tokens"):
                self._json(200, {"input_tokens": 1})
            elif path.endswith("/messages"):
                if body.get("stream"):
                    self._send(200, messages_stream(model), "text/event-stream")
                else:
                    self._json(200, message_json(model))
            else:
                self._json(404, {"error": {"message": "not found", "type": "not_found"}})

    return Handler


# ---------------------------------------------------------------- install and run


def command(cli: str, bins: Path, work: Path, model: str | None) -> list[str]:
    chosen = ["--model", model] if model else []  # '' leaves the CLI's own default
    if cli == "codex":
        return [str(bins / "codex"), "exec", "--skip-git-repo-check", "--sandbox", "read-only",
                "--color", "never", "-C", str(work), *chosen, PROMPT]
    return [str(bins / "claude"), "-p", *chosen, PROMPT]


def run_cli(cli: str, bins: Path, runs: Path, timeout: float, isolated: bool,
            strace: bool, model: str | None) -> dict[str, Any]:
    """Runs one CLI against a fresh recorder; returns the recorded requests and outcome."""
    recorder = Recorder()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(recorder))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    base_url = f"http://127.0.0.1:{port}" + ("/v1" if cli == "codex" else "")
    run = Path(tempfile.mkdtemp(prefix=f"{cli}-", dir=runs))
    home, work = run / "home", run / "home" / "project"
    work.mkdir(parents=True)
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text(codex_config(base_url, "capture"))
    argv = command(cli, bins, work, model)
    trace = run / "strace.log"
    if strace and shutil.which("strace"):
        argv = ["strace", "-f", "-qq", "-e", "trace=connect", "-o", str(trace), *argv]
    started = time.monotonic()
    try:
        env = quiet_env(home, base_url, FAKE_KEY, proxied=not isolated)
        proc = subprocess.run(argv, cwd=work, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
        rc: int | str = proc.returncode
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        stdout = _text(exc.stdout)
        stderr = _text(exc.stderr)
    finally:
        server.shutdown()
        server.server_close()
    return {"cli": cli, "rc": rc, "seconds": round(time.monotonic() - started, 1),
            "stdout": stdout[-2000:], "stderr": stderr[-4000:], "requests": recorder.requests,
            "connects": _connects(trace, port) if trace.exists() else None,
            "home": str(home), "work": str(work), "run": str(run)}


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _connects(trace: Path, port: int) -> list[str]:
    """Distinct connect() targets other than the recorder (what the CLI tried to reach)."""
    seen: list[str] = []
    for line in trace.read_text(errors="replace").splitlines():
        match = re.search(r'sin6?_port=htons\((\d+)\).*?(?:inet_addr\("([^"]+)"\)|'
                          r'inet_pton\(AF_INET6, "([^"]+)")', line)
        unix = re.search(r'sun_path="([^"]+)"', line)
        if match:
            target = f"{match.group(2) or match.group(3)}:{match.group(1)}"
            if target == f"127.0.0.1:{port}":
                continue
            result = line.rsplit("=", 1)[-1].strip()
            target = f"{target} -> {result}"
        elif unix:
            target = f"unix:{unix.group(1)}"
        else:
            continue
        if target not in seen:
            seen.append(target)
    return seen


# ---------------------------------------------------------------- fixtures


def scrub(value: Any, replacements: list[tuple[str, str]]) -> Any:
    """The value with the run's paths replaced by placeholders and the key removed."""
    text = json.dumps(value)
    for old, new in replacements:
        text = text.replace(json.dumps(old)[1:-1], new)
    return json.loads(text)


def fixture(capture: dict[str, Any]) -> dict[str, Any]:
    cli = capture["cli"]
    endpoint = "/responses" if cli == "codex" else "/messages"
    model_calls = [r for r in capture["requests"]
                   if r["method"] == "POST" and r["path"].split("?")[0].endswith(endpoint)]
    if not model_calls:
        raise SystemExit(f"{cli}: no {endpoint} request was recorded "
                         f"(rc={capture['rc']}):\n{capture['stderr']}")
    first = model_calls[0]
    replacements = [(capture["work"], "/home/user/project"), (capture["home"], "/home/user"),
                    (capture["run"], "/home"), (FAKE_KEY, "<api-key>")]
    headers = first["headers"]
    package, version = PACKAGES[cli]
    return scrub({
        "cli": package, "version": version, "prompt": PROMPT,
        "captured_with": "tests/bench/capture_cli_requests.py",
        "method": first["method"], "path": first["path"],
        "headers": {k: headers[k] for k in KEPT_HEADERS if k in headers},
        "other_header_names": sorted(k for k in headers
                                     if k not in KEPT_HEADERS and k not in SECRET_HEADERS),
        "removed_secret_headers": sorted(k for k in headers if k in SECRET_HEADERS),
        "body": first["body"],
        "session_requests": [{"method": r["method"], "path": r["path"],
                              "model": (r["body"] or {}).get("model")
                              if isinstance(r["body"], dict) else None,
                              "stream": (r["body"] or {}).get("stream")
                              if isinstance(r["body"], dict) else None}
                             for r in capture["requests"]],
    }, replacements)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # Outside any git checkout and outside /tmp (tests/streaming/agent_clis.py says why).
    parser.add_argument("--cache", type=Path, default=cache_dir(),
                        help="npm prefix and run folders (default: ~/.cache/sluice-agent-clis)")
    parser.add_argument("--out", type=Path, default=REPO / "tests/streaming/fixtures")
    parser.add_argument("--only", choices=sorted(PACKAGES), action="append")
    # A user pointing a CLI at Sluice names a Sluice deployment; the CLIs shape the request
    # by model (Codex sends its default model's tools as an `additional_tools` input item
    # and a top-level `tools` list for a model it does not know), so the fixtures use one.
    parser.add_argument("--model", default="echo",
                        help="model the CLIs are given (default: echo; '' for each CLI's own)")
    parser.add_argument("--suffix", default="",
                        help="inserted before .json in the fixture names")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--strace", action="store_true", help="list the CLIs' connect() calls")
    parser.add_argument("--raw", action="store_true",
                        help="also write every recorded request under the run folder")
    parser.add_argument("--no-netns", action="store_true",
                        help="skip the network namespace (proxy-only isolation)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cache = args.cache.resolve()
    if not args.inner:
        install(cache)
        if not args.no_netns and netns_works():
            inner = [sys.executable, str(Path(__file__).resolve()), "--inner", *sys.argv[1:]]
            script = 'ip link set lo up && exec "$@"'
            return subprocess.call(["unshare", "-rn", "sh", "-c", script, "sh", *inner])
    isolated = args.inner
    bins = cache / "npm" / "node_modules" / ".bin"
    runs = cache / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"network: {'namespace with loopback only' if isolated else 'proxy to a closed port'}")
    for cli in args.only or sorted(PACKAGES, reverse=True):
        capture = run_cli(cli, bins, runs, args.timeout, isolated, args.strace, args.model)
        if args.raw:
            raw = Path(capture["run"]) / "requests.json"
            for r in capture["requests"]:
                for name in SECRET_HEADERS:
                    r["headers"].pop(name, None)
            raw.write_text(json.dumps(capture, indent=1))
        print(f"{cli}: rc={capture['rc']} in {capture['seconds']}s, "
              f"{len(capture['requests'])} request(s):")
        for r in capture["requests"]:
            print(f"  {r['method']} {r['path']}")
        if capture["connects"] is not None:
            print(f"  other connect() attempts: {capture['connects'] or 'none'}")
        if capture["rc"] != 0:
            print(f"  stderr tail: {capture['stderr'][-1500:]}")
        data = fixture(capture)
        path = args.out / FIXTURES[cli].replace(".json", f"{args.suffix}.json")
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print(f"  wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
