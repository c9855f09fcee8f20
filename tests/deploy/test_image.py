"""The CPU image builds, starts and serves: `sluice run` in the container (as the
image's non-root user, on the host's network so that it reaches this test's Redis)
becomes ready, answers a chat completion from the chat model baked into the image, and
stops cleanly on SIGTERM.

Needs a running container engine (a Docker daemon with BuildKit) and the base image
(SLUICE_IMAGE_BASE, default python:3.11-slim-bookworm) present or pullable; skipped with
the reason otherwise. platform/deploy/README.md says what was measured here."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from sluice.localinfra import free_port
from tests.conftest import REPO, eventually
from tests.deploy.containerfile import stages
from tests.deploy.manifests import DEPLOY

pytestmark = pytest.mark.slow
IMAGE = "sluice:test"


def _engine() -> tuple[list[str], dict[str, str]]:
    """A client command that builds with BuildKit against a running engine, and its
    environment; skips when there is none."""
    reasons = []
    found = [shutil.which("docker"), "/usr/bin/docker"]
    for client in dict.fromkeys(c for c in found if c and os.access(c, os.X_OK)):
        server = subprocess.run([client, "version", "--format", "{{.Server.Version}}"],
                                capture_output=True, text=True, timeout=30)
        if server.returncode != 0:
            reasons.append(f"{client}: {server.stderr.strip().splitlines()[-1:]}")
            continue
        if subprocess.run([client, "buildx", "version"], capture_output=True,
                          timeout=30).returncode == 0:
            return [client, "buildx", "build", "--load"], dict(os.environ)
        major = subprocess.run([client, "version", "--format", "{{.Client.Version}}"],
                               capture_output=True, text=True, timeout=30).stdout
        if major.split(".")[0].isdigit() and int(major.split(".")[0]) < 23:
            return [client, "build"], {**os.environ, "DOCKER_BUILDKIT": "1"}
        reasons.append(f"{client}: no buildx and no built-in BuildKit")
    pytest.skip(f"no container engine to build with here ({'; '.join(reasons) or 'no docker'})")


def _context(into: Path) -> Path:
    """What the Containerfile copies, plus the local torch CPU wheel when pip has one."""
    for rest in stages(DEPLOY / "Containerfile")[0].args("COPY"):
        *sources, _ = rest.split()
        for source in sources:
            origin, target = REPO / source, into / source
            if origin.is_dir():
                shutil.copytree(origin, target, ignore=shutil.ignore_patterns(
                    "__pycache__", "*_pb2*.py*", "*.whl"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target)
    for links in os.environ.get("PIP_FIND_LINKS", "").split():
        for wheel in Path(links).glob("torch-2.13.0+cpu-*.whl"):
            shutil.copy2(wheel, into / "platform/deploy/wheels" / wheel.name)
    return into


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    build, env = _engine()
    client = build[0]
    base = os.environ.get("SLUICE_IMAGE_BASE", "python:3.11-slim-bookworm")
    if subprocess.run([client, "image", "inspect", base], capture_output=True,
                      timeout=60).returncode != 0:
        pulled = subprocess.run([client, "pull", base], capture_output=True, text=True,
                                timeout=300)
        if pulled.returncode != 0:
            pytest.skip(f"base image {base} is not here and cannot be pulled: "
                        f"{pulled.stderr.strip()[-300:]}")
    context = _context(tmp_path_factory.mktemp("image"))
    extra = []
    cert = os.environ.get("PIP_CERT")
    if cert and Path(cert).is_file():  # a TLS-inspecting proxy's CA, as pip here uses it
        extra = ["--secret", f"id=pip_cert,src={cert}"]
    result = subprocess.run(
        [*build, "-f", str(DEPLOY / "Containerfile"), "--build-arg",
         f"BASE={base}", *extra, "-t", IMAGE, str(context)],
        capture_output=True, text=True, env=env, timeout=3000)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return client


@pytest.fixture
def running(image: str) -> Iterator[tuple[str, str, str]]:
    client, name, port = image, f"sluice-test-{secrets.token_hex(4)}", free_port()
    subprocess.run(
        [client, "run", "-d", "--name", name, "--network", "host",
         "-e", f"REDIS_URL={settings.REDIS_URL}", "-e",
         f"SLUICE_SECRET_KEY={secrets.token_urlsafe(48)}", IMAGE, "sluice", "run",
         "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(free_port())],
        check=True, capture_output=True, timeout=120)
    try:
        yield client, name, f"http://127.0.0.1:{port}"
    finally:
        subprocess.run([client, "rm", "-f", name], capture_output=True, timeout=120)


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.timeout(3600)
def test_the_image_builds_starts_serves_and_stops(running: tuple[str, str, str]) -> None:
    client, name, base = running
    eventually(lambda: _ready(base), 300, what="the container's /readyz")

    def logs() -> str:
        return subprocess.run([client, "logs", name], capture_output=True, text=True,
                              timeout=60).stdout

    found = eventually(lambda: re.search(r"sk-sluice-[A-Za-z0-9_-]+", logs()), 60,
                       what="the demo key in the banner")
    assert found is not None
    key = found.group(0)
    reply = httpx.post(f"{base}/v1/chat/completions", timeout=300,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"model": "smollm2-135m-instruct", "max_tokens": 8,
                             "messages": [{"role": "user", "content": "Say hello."}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"].strip()

    def run(*argv: str) -> str:
        return subprocess.run([client, "exec", name, *argv], capture_output=True, text=True,
                              check=True, timeout=120).stdout.strip()

    assert run("id", "-u") == "10001"
    assert run("python", "-c", "import torch; print(torch.__version__, "
                               "torch.cuda.is_available())") == "2.13.0+cpu False"
    began = time.monotonic()
    subprocess.run([client, "stop", "-t", "60", name], check=True, capture_output=True,
                   timeout=120)
    assert time.monotonic() - began < 60, "stopped by SIGTERM, not killed at the deadline"
    state = subprocess.run([client, "inspect", name, "--format", "{{.State.ExitCode}}"],
                           capture_output=True, text=True, check=True, timeout=60).stdout
    assert state.strip() == "0"
