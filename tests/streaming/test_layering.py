"""The transports and codecs only encode: none of them writes an audit event itself (the
call and its settlement do: streaming/pipeline/call.py, streaming/pipeline/submitted.py) or
reads a worker
event's tag (`event["t"]`, `event.get("t")`) instead of the pieces of the one fold
(streaming/pipeline/fold.py). Outside inference/ (where events are made and defined), no module
but the fold reads a tag at all: the pipeline asks inference/jobs.py's `is_final` and
its kin. Checked on each module's syntax tree, so that no spelling or formatting of the
same access escapes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STREAMING = ROOT / "streaming"
# The transports, the API codecs (their bodies, SSE, stored responses), the Batch and
# Files APIs.
ENCODERS = sorted({*STREAMING.glob("transports/*.py"), *STREAMING.glob("apis/**/*.py"),
                   *STREAMING.glob("batches/*.py")} - set(STREAMING.rglob("__init__.py")))
FOLD = STREAMING / "pipeline" / "fold.py"
# Every module of the gateway's apps and kernel but the fold (and inference/'s).
GATEWAY = sorted(path for app in ("streaming", "governance", "tenants", "frontend",
                                  "platform")
                 for path in (ROOT / app).rglob("*.py")
                 if path != FOLD and "migrations" not in path.parts)
# What writes an audit event: the audit module's builders, a recorder's audit().
AUDIT_MODULES = {"governance.audit", "governance.recorder"}
AUDIT_NAMES = {"call_event", "resume_event", "recorder"}


def violations(source: str) -> list[str]:
    """What in `source` reads an event's tag or writes an audit event, by line."""
    found = tag_reads(source)
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and node.attr in AUDIT_NAMES:
            found.append(f"{line}: audits (.{node.attr})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "audit":
            found.append(f"{line}: audits (.audit())")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            found += [f"{line}: imports {name}" for name in _imported(node)
                      if name in AUDIT_MODULES or name.rsplit(".", 1)[-1] in AUDIT_NAMES]
    return found


def tag_reads(source: str) -> list[str]:
    """Where `source` reads an event's tag, by line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Subscript) and _is_tag(node.slice):
            found.append(f"{line}: reads [\"t\"]")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("get", "pop", "setdefault") and node.args \
                and _is_tag(node.args[0]):
            found.append(f"{line}: reads .{node.func.attr}(\"t\")")
        elif isinstance(node, ast.Compare) and _is_tag(node.left) \
                and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            found.append(f"{line}: tests \"t\" in")
        elif isinstance(node, ast.Name | ast.Attribute) and \
                (node.id if isinstance(node, ast.Name) else node.attr) == "FINAL_EVENTS":
            found.append(f"{line}: uses FINAL_EVENTS")
        elif isinstance(node, ast.ImportFrom):
            found += [f"{line}: imports {name}" for name in _imported(node)
                      if name.endswith(".FINAL_EVENTS")]
    return found


def _is_tag(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == "t"


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    module = node.module or ""
    return [module, *(f"{module}.{alias.name}" for alias in node.names)]


@pytest.mark.parametrize("path", ENCODERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_an_encoder_neither_reads_event_tags_nor_audits(path: Path) -> None:
    assert violations(path.read_text()) == []


def test_only_the_fold_reads_event_tags_outside_inference() -> None:
    reads = {str(path.relative_to(ROOT)): found for path in GATEWAY
             if (found := tag_reads(path.read_text()))}
    assert reads == {}


@pytest.mark.parametrize("source", [
    'kind = event["t"]',
    "kind = event [ 't' ]",
    'if e.get("t") == "done": pass',
    "done = ev.get('t', None)",
    'if "t" in event: pass',
    "from inference.jobs import FINAL_EVENTS",
    "if x in jobs.FINAL_EVENTS: pass",
    "gateway.governor.recorder.audit(event)",
    "self.audit(event)",
    "from governance import audit",
    "import governance.audit as a",
    "from governance.audit import call_event",
    "e = replay.resume_event(p, rid)",
])
def test_the_check_finds_each_spelling(source: str) -> None:
    assert violations(source)


def test_the_check_sees_the_fold_read_tags() -> None:
    """The check is no vacuous pass: it sees the fold, which does read them."""
    assert tag_reads(FOLD.read_text())
    assert len(ENCODERS) >= 20 and len(GATEWAY) >= 150


def test_only_the_sse_start_writes_an_event_streams_headers() -> None:
    """No codec writes an SSE preamble of its own (streaming/apis/sse.py does, for all)."""
    writers = sorted(str(path.relative_to(ROOT)) for path in GATEWAY
                     for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Constant) and isinstance(node.value, bytes)
                     and b"text/event-stream" in node.value)
    assert writers == ["streaming/apis/sse.py"]
