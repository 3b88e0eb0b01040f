"""The scripted remote A2A agent as its own process (`python -m tests.e2e.a2a.remote_main PORT`), so a
test can kill it mid-stream."""

from __future__ import annotations

import asyncio
import sys

from tests.e2e.a2a.remote_server import start_remote


async def main(port: int) -> None:
    await start_remote(port)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
