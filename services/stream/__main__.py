"""`python -m services.stream`: one stream-service process configured from AGENTMESH_* variables."""

from __future__ import annotations

import agentmesh  # noqa: F401  (first: gRPC's transport, as every process of the mesh has it)

# isort: split
import logging

from libs.aio import run
from libs.config import load_settings
from services.stream.server import main

if __name__ == "__main__":
    settings = load_settings()
    logging.basicConfig(level=settings.log_level)
    run(main(settings))
