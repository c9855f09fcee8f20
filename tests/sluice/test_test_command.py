"""The test command's own choices: what each pytest-xdist worker owns (tests/parallel.py),
how many workers a run gets, and what the cluster pass selects (the `cluster` mark)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sluice.root.cli import REPO, _parallel
from tests import parallel


def test_each_worker_gets_its_own_redis_databases_and_state_dir(tmp_path: Path) -> None:
    base = {"REDIS_URL": "redis://127.0.0.1:6379/15", "SLUICE_STATE_DIR": str(tmp_path),
            "SLUICE_CELERY_REDIS_URL": "redis://127.0.0.1:6379/9?protocol=3"}
    made = []
    for worker in ("gw0", "gw1"):
        env = {**base, parallel.WORKER: worker}
        parallel.isolate(env)
        parallel.isolate(env)  # once per worker: a second call changes nothing
        made.append(env)
    assert [e["REDIS_URL"] for e in made] == ["redis://127.0.0.1:6379/15",
                                               "redis://127.0.0.1:6379/14"]
    assert [e["SLUICE_CELERY_REDIS_URL"] for e in made] == [
        "redis://127.0.0.1:6379/9?protocol=3", "redis://127.0.0.1:6379/8?protocol=3"]
    assert [e["SLUICE_STATE_DIR"] for e in made] == [str(tmp_path / "gw0"),
                                                      str(tmp_path / "gw1")]
    assert all((tmp_path / w).is_dir() for w in ("gw0", "gw1"))
    assert [e[parallel.MARK] for e in made] == ["gw0", "gw1"]


def test_listed_urls_go_one_per_worker_and_a_process_that_is_no_worker_is_left_alone(
        ) -> None:
    urls = ("redis+cluster://127.0.0.1:7000,127.0.0.1:7001/ "
            "redis+cluster://127.0.0.1:7100,127.0.0.1:7101/")
    env = {"REDIS_URL": "redis+cluster://127.0.0.1:7000,127.0.0.1:7001/",
           parallel.URLS: urls, parallel.WORKER: "gw1"}
    parallel.isolate(env)
    assert env["REDIS_URL"] == "redis+cluster://127.0.0.1:7100,127.0.0.1:7101/"
    alone = {"REDIS_URL": "redis://127.0.0.1:6379/3"}
    parallel.isolate(alone)
    assert alone == {"REDIS_URL": "redis://127.0.0.1:6379/3"}


@pytest.mark.parametrize(("env", "error"), [
    ({"REDIS_URL": "redis://127.0.0.1:6379/1", parallel.WORKER: "gw2"}, "no Redis database"),
    ({"REDIS_URL": "redis+cluster://127.0.0.1:7000/", parallel.WORKER: "gw1"}, "single"),
    ({parallel.URLS: "redis://a:1/0", parallel.WORKER: "gw1"}, "none for gw1"),
    ({"REDIS_URL": "redis://127.0.0.1:6379/1", parallel.WORKER: "main"}, "worker id")])
def test_a_worker_that_cannot_have_its_own_redis_is_an_error(env: dict[str, str],
                                                             error: str) -> None:
    with pytest.raises(RuntimeError, match=error):
        parallel.isolate(env)


@pytest.mark.parametrize(("args", "options", "workers"), [
    (["-k", "jwt"], ["-n", "CORES", "--dist", "loadfile"], "CORES"),
    (["-n", "0"], [], 0), (["-n3"], ["--dist", "loadfile"], 3),
    (["-n", "2", "--dist", "load"], [], 2), (["-p", "no:xdist"], [], 0)])
def test_a_run_has_a_worker_per_core_unless_the_arguments_say(
        args: list[str], options: list[str], workers: int | str) -> None:
    import os

    cores = str(len(os.sched_getaffinity(0)))
    assert _parallel(args) == ([cores if o == "CORES" else o for o in options],
                               int(cores) if workers == "CORES" else workers)


# One live module per API and per transport runs on the cluster (beside the tests of
# what Redis's topology changes: scripts and their key slots, pipelines, the queue).
SMOKES = {
    "chat, embeddings, REST and SSE": "tests/streaming/test_openai_sdk.py",
    "completions": "tests/streaming/test_completions.py",
    "responses": "tests/streaming/test_responses.py",
    "messages": "tests/streaming/test_anthropic.py",
    "batches and files": "tests/streaming/test_batches.py",
    "gRPC": "tests/streaming/test_grpc.py",
    "WebSocket": "tests/streaming/test_websocket.py",
}


def _marks(path: Path) -> str:
    tree = ast.parse(path.read_text())
    return " ".join(ast.unparse(node.value) for node in tree.body
                    if isinstance(node, ast.Assign)
                    and any(getattr(t, "id", "") == "pytestmark" for t in node.targets))


def test_every_api_and_transport_has_a_live_module_in_the_cluster_pass() -> None:
    unmarked = {what: path for what, path in SMOKES.items()
                if "pytest.mark.cluster" not in _marks(REPO / path)}
    assert not unmarked, unmarked


def test_no_module_marked_for_the_cluster_pass_is_single_redis_only() -> None:
    both = [str(p.relative_to(REPO)) for p in sorted((REPO / "tests").rglob("test_*.py"))
            if "pytest.mark.cluster" in (m := _marks(p))
            and ("single_redis" in m or "RELAYED" in m)]
    assert not both, f"marked for the cluster pass and skipped there: {both}"
