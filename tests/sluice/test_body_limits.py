"""Bodies are limited before Django reads them (sluice/bodylimit.py): against the real
ASGI app under uvicorn, over raw sockets, since an HTTP client would send the body."""

from __future__ import annotations

import json
import select
import socket
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.bodylimit import declared_length
from sluice.errors import BadRequest
from streaming.models import StoredFile
from tenants.roles import Role
from tests.conftest import Org, uvicorn_server

CHUNK = 64 * 1024


@pytest.fixture
def port(transactional_db: None) -> Iterator[int]:
    with uvicorn_server() as serving:
        yield serving


def _response(sock: socket.socket) -> tuple[int, dict[str, Any], bytes]:
    """The status, JSON body and raw head of the one response on `sock`."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        part = sock.recv(65536)
        assert part, f"connection closed before a response: {raw!r}"
        raw += part
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        part = sock.recv(65536)
        assert part
        body += part
    return int(head.split(b" ")[1]), json.loads(body[:length]), head


def _declared(port: int, path: str, length: int) -> tuple[int, dict[str, Any], bytes]:
    """Send only the head of a request declaring `length` bytes of body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
                     .encode())
        return _response(sock)


def _chunked_flood(port: int, path: str, total: int) -> tuple[int, dict[str, Any], int]:
    """Send a chunked body of up to `total` bytes, stopping once a response arrives:
    (status, JSON body, bytes of body sent before it)."""
    chunk = b"%x\r\n%s\r\n" % (CHUNK, b"x" * CHUNK)
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     .encode())
        while sent < total:
            if select.select([sock], [], [], 0)[0]:
                break  # the server answered mid-body
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += CHUNK
        status, body, _ = _response(sock)
        return status, body, sent


def _assert_too_large(body: dict[str, Any]) -> None:
    assert set(body) == {"error"}
    assert body["error"]["code"] == "payload_too_large"
    assert body["error"]["type"] == "invalid_request_error"


def test_a_declared_length_over_the_limit_is_refused_before_any_body(port: int) -> None:
    for path in ("/api/v1/tenants", "/ui/login", "/v1/batches", "/v1/files"):
        # Given no credentials and no body at all, only a 2 GB Content-Length
        status, body, head = _declared(port, path, 2_000_000_000)
        # Then the answer comes without waiting for a byte of it, closing the connection
        assert status == 413, path
        _assert_too_large(body)
        assert b"connection: close" in head.lower()
    # And within the limit, declared or chunked, Django has the body (and answers 401)
    url = f"http://127.0.0.1:{port}/api/v1/tenants"
    assert httpx.post(url, content=b"{}").status_code == 401
    assert httpx.post(url, content=iter([b"{", b"}"])).status_code == 401  # chunked


def test_a_chunked_body_past_the_limit_is_cut_off(port: int, settings: Any) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 256 * 1024
    # When 64 MB are streamed without a length
    status, body, sent = _chunked_flood(port, "/api/v1/tenants", 64 * 1024 * 1024)
    # Then 413 comes once the limit is passed, and the server stopped reading (what was
    # sent beyond the limit is at most what the sockets' buffers hold)
    assert status == 413
    _assert_too_large(body)
    assert sent < 32 * 1024 * 1024


def test_an_upload_streams_to_its_file_within_the_limit(port: int, alice: Org,
                                                        settings: Any) -> None:
    settings.SLUICE_MAX_FILE_BYTES = 20 * 1024 * 1024
    url = f"http://127.0.0.1:{port}/v1/files"
    auth = {"Authorization": f"Bearer {alice.keys[Role.DEVELOPER]}"}
    content = b'{"custom_id": "1"}\n' * (16 * 1024 * 1024 // 19)
    boundary = "sluice-test-boundary"
    upload = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
              f"batch\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
              f"filename=\"in.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n"
              ).encode() + content + f"\r\n--{boundary}--\r\n".encode()
    head = (f"POST /v1/files HTTP/1.1\r\nHost: localhost\r\n"
            f"Authorization: {auth['Authorization']}\r\nContent-Length: {len(upload)}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n").encode()
    # When a 16 MB file is uploaded, memory traced in the server's threads too (the
    # body was built before, so the peak is what sending and serving it took)
    tracemalloc.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(head)
            sock.sendall(upload)  # a raw socket: an HTTP client would copy the body
            status, created, _ = _response(sock)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Then it is stored whole, and was never held whole in memory
    assert status == 200, created
    row = StoredFile.objects.get(public_id=created["id"])
    assert row.bytes == len(content)
    assert Path(row.path).read_bytes() == content
    assert peak < len(content) // 2, peak
    # And past the limit: 413, declared or chunked, and no file is left behind
    settings.SLUICE_MAX_FILE_BYTES = 1024 * 1024
    over = httpx.post(url, headers=auth, data={"purpose": "batch"},
                      files={"file": ("in.jsonl", content)}, timeout=60)
    assert over.status_code == 413
    _assert_too_large(over.json())
    status, body, sent = _chunked_flood(port, "/v1/files", 64 * 1024 * 1024)
    assert status == 413 and sent < 32 * 1024 * 1024
    _assert_too_large(body)
    assert StoredFile.objects.count() == 1


def test_content_length_is_parsed_strictly() -> None:
    assert declared_length([]) is None
    assert declared_length([(b"content-length", b"12")]) == 12
    assert declared_length([(b"Content-Length", b"7"), (b"content-length", b"7")]) == 7
    for bad in ([(b"content-length", b"-1")], [(b"content-length", b"1e9")],
                [(b"content-length", b"1"), (b"content-length", b"2")],
                [(b"content-length", b"9" * 20)]):
        with pytest.raises(BadRequest, match="Content-Length"):
            declared_length(bad)
