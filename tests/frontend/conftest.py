"""The live server (uvicorn + in-thread workers) for the browser tests."""

from tests.streaming.conftest import live  # noqa: F401
