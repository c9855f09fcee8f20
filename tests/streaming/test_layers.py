"""streaming/'s folders are its layers, and each imports only those below it:

    transports/   the ASGI app, the gRPC service, the WebSocket consumer, OpenAPI
    apis/, batches/, tasks   the API codecs (with their bodies, SSE, stored responses);
                  the Batch and Files APIs and their Celery tasks
    pipeline/     the call: admission, submission, events, settlement
    models        the stored rows

Only these modules sit at streaming/'s top: __init__, apps, models, api (the Files,
Batch and stored-response routes of the management API) and tasks. Imports under
`if TYPE_CHECKING:` are annotations only and not counted. Checked on each module's
syntax tree (docs/ARCHITECTURE.md draws the picture)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STREAMING = ROOT / "streaming"
RANK = {"transports": 3, "apis": 2, "batches": 2, "tasks": 2, "pipeline": 1,
        "models": 0, "protos": 0}
TOP = {"__init__.py", "apps.py", "models.py", "api.py", "tasks.py"}
MODULES = sorted(p for p in STREAMING.rglob("*.py")
                 if "migrations" not in p.parts and "management" not in p.parts
                 and "_pb2" not in p.name)


def layer(module: str) -> str | None:
    """The layer of a dotted `streaming.<layer>...` name (None for streaming itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "streaming" else None


def runtime_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import that runs, at any depth: those under
    `if TYPE_CHECKING:` left out."""
    tree = ast.parse(source)
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
            # `from streaming import x` imports the module streaming.x
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                      if node.module == "streaming"]
    return found


def upward(path: Path) -> list[str]:
    """The imports of `path` that reach a layer above its own."""
    own = layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
    if own not in RANK:
        return []
    return [f"{line}: {module}" for line, module in runtime_imports(path.read_text())
            if (other := layer(module)) in RANK and RANK[other] > RANK[own]]


def test_streaming_has_no_loose_modules() -> None:
    loose = sorted(p.name for p in STREAMING.glob("*.py"))
    assert set(loose) <= TOP, set(loose) - TOP


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_imports_no_layer_above_its_own(path: Path) -> None:
    assert upward(path) == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """No vacuous pass: a pipeline module importing a codec, at any depth and in either
    spelling, is caught; one under TYPE_CHECKING is not."""
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from streaming.transports.asgi import LeanApp\n"
              "def f():\n    from streaming.apis import chat\n"
              "import streaming.batches.lines\n")
    found = [m for _line, m in runtime_imports(source)]
    assert "streaming.apis" in found and "streaming.batches.lines" in found
    assert "streaming.transports.asgi" not in found
    assert len(MODULES) > 40
