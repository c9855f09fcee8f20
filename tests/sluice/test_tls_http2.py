"""TLS and HTTP/2 at the edge. The run command's HTTP server (servers.choose and
http_command, as cli.cmd_run builds it) with a self-signed certificate made here serves
REST and SSE over HTTP/2 (ALPN h2) and HTTP/1.1, the official openai client and the
WebSocket over TLS; without TLS, h2c by prior knowledge beside HTTP/1.1; the gRPC server
takes TLS from the settings. Real echo workers, Redis and PostgreSQL behind."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import websockets
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from governance import audit
from inference import cache as registry_cache
from inference.models import Deployment
from inference.worker import Worker
from sluice import servers
from sluice.localinfra import free_port
from sluice.redis import sync_client
from sluice.root.grpcserver import build
from sluice.servers import Tls, choose, http_command
from sluice.settings import tls as tls_settings
from streaming.protos import inference_pb2 as pb
from streaming.protos import inference_pb2_grpc as pb_grpc
from tenants import cache as auth_cache
from tenants.roles import Role
from tests.conftest import REPO, eventually, make_org, process_env

pytestmark = pytest.mark.slow
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "over the edge"}]}


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    """A self-signed P-256 certificate for localhost and 127.0.0.1, and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256()))
    folder = tmp_path_factory.mktemp("tls")
    (folder / "cert.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return Tls(str(folder / "cert.pem"), str(folder / "key.pem"))


def trust(cert: Tls, *, max_version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    """A client context that trusts only `cert`."""
    context = ssl.create_default_context(cafile=cert.cert_file)
    if max_version is not None:
        context.maximum_version = max_version
    return context


@pytest.fixture
def key(transactional_db: None) -> Iterator[str]:
    """A developer's API key, with an echo deployment served by a worker thread."""
    sync_client(settings.REDIS_URL).flushdb()
    auth_cache.clear()
    registry_cache.clear()
    spec = Deployment.objects.create(name="echo", runtime="echo", max_batch_size=8,
                                     echo_token_delay_ms=2).to_spec()
    org = make_org("edgeorg", [Role.DEVELOPER])
    worker = Worker(spec, sync_client(settings.REDIS_URL), block_ms=200)
    thread = threading.Thread(target=worker.run, kwargs={"drain_s": 1}, daemon=True)
    thread.start()
    yield org.keys[Role.DEVELOPER]
    audit.drain()
    worker.stopping.set()
    thread.join(10)


@contextlib.contextmanager
def edge(tls: Tls | None, server: str, *, verify: ssl.SSLContext | bool = True
         ) -> Iterator[str]:
    """The HTTP server the run command starts (`server`, HTTP version auto) in a process
    of its own on a free loopback port, once /healthz answers: its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        http_command(server, "sluice.root.asgi:application", host="127.0.0.1", port=port,
                     tls=tls), cwd=REPO, env=process_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        def up() -> bool:
            try:
                return httpx.get(f"{base}/healthz", timeout=1, verify=verify).is_success
            except httpx.HTTPError:
                return proc.poll() is not None  # exited: stop waiting
        eventually(up, 60, what="the HTTP server")
        assert proc.poll() is None, "the HTTP server exited"
        yield base
    finally:
        proc.terminate()
        proc.wait(15)


async def sse_text(client: httpx.AsyncClient, url: str, key: str) -> tuple[str, str]:
    """(HTTP version, the text an SSE chat stream's deltas add up to) of one stream;
    asserts that it ends with [DONE]."""
    body = {**CHAT, "stream": True}
    async with client.stream("POST", url, json=body, timeout=30,
                             headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200
        data = [line[6:] async for line in response.aiter_lines()
                if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                   for d in data[:-1] if json.loads(d)["choices"])
    return response.http_version, text


def test_the_run_command_serves_tls_and_http2_with_granian(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a certificate, or HTTP/2 only: granian, the server that speaks HTTP/2
    assert choose(None, tls=True) == "granian"
    assert choose(None, tls=False, http="2") == "granian"
    # Without either, the default; a named server is kept
    assert choose(None, tls=False) == servers.DEFAULT
    assert choose("uvicorn", tls=True) == "uvicorn"
    # Then granian offers TLS 1.2 and up, HTTP auto (h2 by ALPN beside http/1.1)
    command = http_command("granian", "a:b", host="h", port=1, tls=Tls("c.pem", "k.pem"))
    assert command[command.index("--ssl-protocol-min") + 1] == "tls1.2"
    assert command[command.index("--http") + 1] == "auto"
    # And what a server cannot serve is refused before it starts
    with pytest.raises(ValueError, match="HTTP/2 needs granian"):
        http_command("uvicorn", "a:b", host="h", port=1, http="2")
    with pytest.raises(ValueError, match="daphne"):
        http_command("daphne", "a:b", host="h", port=1, tls=Tls("c", "k"))
    with pytest.raises(ValueError, match=r"missing\.pem"):
        Tls(str(tmp_path / "missing.pem"), str(tmp_path / "missing.pem")).check()
    # And the settings take a certificate and its key together, or neither
    monkeypatch.setenv("SLUICE_TLS_CERT_FILE", "/run/secrets/tls.crt")
    monkeypatch.delenv("SLUICE_TLS_KEY_FILE", raising=False)
    with pytest.raises(ImproperlyConfigured, match="set both or neither"):
        tls_settings._pair("SLUICE_TLS_CERT_FILE", "SLUICE_TLS_KEY_FILE")


def test_rest_and_sse_speak_http2_over_tls(key: str, cert: Tls) -> None:
    context = trust(cert)
    with edge(cert, choose(None, tls=True), verify=context) as base:
        url = f"{base}/v1/chat/completions"

        async def calls() -> tuple[httpx.Response, list[tuple[str, str]], httpx.Response]:
            async with httpx.AsyncClient(http2=True, verify=context) as h2:
                rest = await h2.post(url, json=CHAT, timeout=30,
                                     headers={"Authorization": f"Bearer {key}"})
                # three SSE streams at once on the client's one connection
                streams = await asyncio.gather(*(sse_text(h2, url, key) for _ in range(3)))
            async with httpx.AsyncClient(verify=context) as h1:  # ALPN http/1.1 only
                old = await h1.post(url, json=CHAT, timeout=30,
                                    headers={"Authorization": f"Bearer {key}"})
            return rest, list(streams), old

        rest, streams, old = asyncio.run(calls())
        # Then REST and SSE went over HTTP/2, and an HTTP/1.1 client is served too
        assert rest.status_code == 200 and rest.http_version == "HTTP/2"
        assert rest.json()["choices"][0]["message"]["content"] == "over the edge"
        assert streams == [("HTTP/2", "over the edge")] * 3
        assert old.status_code == 200 and old.http_version == "HTTP/1.1"
        # And TLS 1.3 is preferred, 1.2 still accepted, h2 chosen by ALPN
        host, port = "127.0.0.1", int(base.rsplit(":", 1)[1])
        for max_version, expected in ((None, "TLSv1.3"), (ssl.TLSVersion.TLSv1_2, "TLSv1.2")):
            client = trust(cert, max_version=max_version)
            client.set_alpn_protocols(["h2", "http/1.1"])
            with socket.create_connection((host, port), timeout=10) as raw, \
                    client.wrap_socket(raw, server_hostname="localhost") as tls:
                assert (tls.version(), tls.selected_alpn_protocol()) == (expected, "h2")
        # And plain HTTP to the TLS port fails at once, leaving the server serving
        started = time.monotonic()
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{host}:{port}/healthz", timeout=10)
        assert time.monotonic() - started < 5
        assert httpx.get(f"{base}/healthz", verify=context, timeout=10).is_success


def test_openai_client_and_websocket_over_tls(key: str, cert: Tls) -> None:
    context = trust(cert)
    with edge(cert, choose(None, tls=True), verify=context) as base:
        # Given the official openai client, trusting the certificate
        with httpx.Client(verify=context, http2=True) as http:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, http_client=http)
            reply = client.chat.completions.with_raw_response.create(**CHAT)
            stream = client.chat.completions.create(**CHAT, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        # Then a call and a stream are answered, over HTTP/2
        assert reply.http_response.http_version == "HTTP/2"
        assert reply.parse().choices[0].message.content == "over the edge"
        assert text == "over the edge"

        # And a chat over the WebSocket (HTTP/1.1 upgrade) over wss
        async def over_wss() -> dict[str, Any]:
            async with websockets.connect(f"{base.replace('https', 'wss')}/v1/chat/socket",
                                          ssl=context, open_timeout=30,
                                          additional_headers={"Authorization": f"Bearer {key}"}
                                          ) as ws:
                await ws.send(json.dumps({"type": "chat.request", "id": "r1", "request": CHAT}))
                while True:
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
                    if frame["type"] in ("chat.done", "error"):
                        return frame
        done = asyncio.run(over_wss())
        assert done["type"] == "chat.done", done


def test_h2c_by_prior_knowledge_beside_http1_without_tls(key: str) -> None:
    # Given granian without a certificate (`--server granian`, HTTP version auto)
    with edge(None, "granian") as base:
        url = f"{base}/v1/chat/completions"

        async def calls() -> tuple[httpx.Response, tuple[str, str], httpx.Response]:
            async with httpx.AsyncClient(http1=False, http2=True) as h2c:  # prior knowledge
                rest = await h2c.post(url, json=CHAT, timeout=30,
                                      headers={"Authorization": f"Bearer {key}"})
                stream = await sse_text(h2c, url, key)
            async with httpx.AsyncClient() as h1:
                old = await h1.post(url, json=CHAT, timeout=30,
                                    headers={"Authorization": f"Bearer {key}"})
            return rest, stream, old

        rest, stream, old = asyncio.run(calls())
    # Then HTTP/2 and HTTP/1.1 are both served on the one port
    assert rest.status_code == 200 and rest.http_version == "HTTP/2"
    assert stream == ("HTTP/2", "over the edge")
    assert old.status_code == 200 and old.http_version == "HTTP/1.1"


def test_grpc_over_tls(key: str, cert: Tls, settings: Any) -> None:
    # Given the gRPC server with the HTTP server's certificate pair
    settings.SLUICE_GRPC_TLS_CERT_FILE = cert.cert_file
    settings.SLUICE_GRPC_TLS_KEY_FILE = cert.key_file
    started: dict[str, int] = {}
    stop = threading.Event()

    def run() -> None:
        async def main() -> None:
            server, servicer, port = await build("127.0.0.1:0")
            started["port"] = port
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await server.stop(grace=1)
            await servicer.close()
        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    eventually(lambda: "port" in started, 20, what="the gRPC server")
    target = f"localhost:{started['port']}"
    root = Path(cert.cert_file).read_bytes()
    request = pb.ChatRequest(model="echo", messages=[pb.ChatMessage(role="user",
                                                                    content="over grpc")])

    async def calls() -> tuple[Any, grpc.StatusCode]:
        async with grpc.aio.secure_channel(
                target, grpc.ssl_channel_credentials(root_certificates=root)) as channel:
            reply = await pb_grpc.InferenceStub(channel).Chat(
                request, metadata=(("authorization", f"Bearer {key}"),), timeout=30)
        async with grpc.aio.insecure_channel(target) as plain:
            try:
                await pb_grpc.InferenceStub(plain).Chat(request, timeout=10)
                refused = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as error:
                refused = error.code()
        return reply, refused

    try:
        reply, refused = asyncio.run(calls())
    finally:
        stop.set()
        thread.join(10)
    # Then a call over TLS is answered, and a plaintext one never reaches the service
    assert reply.message.content == "over grpc"
    assert refused == grpc.StatusCode.UNAVAILABLE
