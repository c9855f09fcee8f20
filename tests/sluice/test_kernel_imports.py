"""The kernel imports nothing above it: no module of platform/sluice imports an app
(tenants, inference, governance, streaming, frontend) except those of its composition
root, platform/sluice/root/; and inference/ imports nothing of streaming/. Every import
counts, at any depth (inside a function, under TYPE_CHECKING), read with `ast`."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KERNEL = REPO / "platform" / "sluice"
ROOT = KERNEL / "root"
APPS = {"tenants", "inference", "governance", "streaming", "frontend"}


def imported(path: Path) -> Iterator[tuple[int, str]]:
    """(line, top-level package) of every absolute import in the module at `path`."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


def offenders(folder: Path, forbidden: set[str], allowed: Path | None = None) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        if allowed is not None and allowed in path.parents:
            continue
        found += [f"{path.relative_to(REPO)}:{line} imports {top}"
                  for line, top in imported(path) if top in forbidden]
    return found


def test_the_kernel_imports_apps_only_in_its_composition_root() -> None:
    assert ROOT.is_dir()
    assert offenders(KERNEL, APPS, allowed=ROOT) == []


def test_the_composition_root_is_where_the_apps_are_wired() -> None:
    # The rule above is not vacuous: the root does import the apps it wires.
    wired = {top for path in ROOT.rglob("*.py") for _, top in imported(path)}
    assert {"tenants", "inference", "governance", "streaming"} <= wired


def test_inference_imports_nothing_of_streaming() -> None:
    assert offenders(REPO / "inference", {"streaming"}) == []


def test_an_import_inside_a_function_is_found(tmp_path: Path) -> None:
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from governance.audit import record\n"
                      "    import streaming.pipeline.call as c\n")
    assert list(imported(module)) == [(2, "governance"), (3, "streaming")]


def test_each_app_imports_only_the_apps_below_it() -> None:
    """tenants < inference < governance < streaming (docs/ARCHITECTURE.md): an app may
    import one below it, never one above; frontend and the root sit on top."""
    order = ["tenants", "inference", "governance", "streaming"]
    found = []
    for i, app in enumerate(order):
        found += offenders(REPO / app, {*order[i + 1:], "frontend"})
    assert found == []
