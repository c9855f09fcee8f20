"""`manage.py rungrpc [--address HOST:PORT]`: the gRPC server, until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from django.core.management.base import BaseCommand

from sluice.root.grpcserver import serve


class Command(BaseCommand):
    help = "Serve sluice.v1.Inference over gRPC."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--address", default=os.environ.get("SLUICE_GRPC_ADDRESS",
                                                                "127.0.0.1:50051"))

    def handle(self, *args: Any, address: str, **options: Any) -> None:
        asyncio.run(serve(address))
