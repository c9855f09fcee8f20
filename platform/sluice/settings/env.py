"""Typed environment helpers: every setting that an operator may change is read here.

Each helper names the variable, parses it strictly and fails loudly on a malformed value
(a typo in production should stop the process, not silently fall back to a default).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (true/false), got {raw!r}")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be >= {minimum}, got {value}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_json(name: str, default: Any) -> Any:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ImproperlyConfigured(f"{name} must be JSON: {exc.msg}") from None


def env_secret(name: str, *, state_dir: Path, length: int = 50) -> str:
    """A secret from the environment, else from a generated file under the state dir.

    The file is created once with mode 0600, so a local install keeps the same secret
    across restarts and nothing secret is ever committed to the repository.
    """
    value = os.environ.get(name)
    if value:
        return value
    path = state_dir / name.lower()
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    state_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(length)
    # O_EXCL: two processes starting together must agree on one secret.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(token)
    return token
