"""libs.peer_http against real listeners: reads are retried (bounded, with backoff), writes never; a
peer that did not answer is not dialled again for `down_s`; answers are bounded in size after
decompression; the key goes in the Authorization header."""

from __future__ import annotations

import time
from typing import Any

import pytest

from agentmesh.libs.config import FederationSettings
from agentmesh.libs.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable
from agentmesh.libs.peer_http import PeerClient
from agentmesh.libs.peers import Peer
from tests.e2e.federation.conftest import Fed


def client(url: str, **settings: float) -> PeerClient:
    values: dict[str, Any] = {
        "read_retries": 2,
        "backoff_s": 0.05,
        "timeout_s": 2.0,
        "down_s": 0.0,
        **settings,
    }
    s = FederationSettings(**values)
    return PeerClient(Peer(alias="p", url=url), s)


async def test_reads_are_retried_writes_are_not(fed: Fed) -> None:
    c = client(f"http://127.0.0.1:{fed.canary.port}")  # closes every connection at once
    try:
        before = fed.canary.connections
        started = time.monotonic()
        with pytest.raises(Unavailable, match="did not answer"):
            await c.get("/api/traces/x")
        assert fed.canary.connections - before == 3  # 1 + read_retries
        assert time.monotonic() - started >= 0.05 + 0.1  # the backoff doubles
        before = fed.canary.connections
        with pytest.raises(Unavailable):
            await c.post("/api/traces/x/messages", {"messages": []})
        assert fed.canary.connections - before == 1
    finally:
        await c.close()


async def test_a_peer_that_did_not_answer_is_not_dialled_again_for_a_while(fed: Fed) -> None:
    c = client(f"http://127.0.0.1:{fed.canary.port}", down_s=30.0, read_retries=0)
    try:
        with pytest.raises(Unavailable):
            await c.get("/api/traces/x")
        before = fed.canary.connections
        with pytest.raises(Unavailable, match="a moment ago"):
            await c.get("/api/traces/x")
        with pytest.raises(Unavailable, match="a moment ago"):
            await c.post("/api/traces/x/messages", {})
        assert fed.canary.connections == before
    finally:
        await c.close()


async def test_answers_are_bounded_after_decompression(fed: Fed) -> None:
    tid = "size-bound"
    async with fed.orgb.http() as http:
        created = await http.post("/api/chat", json={"agent": "coder", "message": "x"})
        del created
        sessions = (await http.get("/api/sessions")).json()["sessions"]
        tid = sessions[0]["id"]
        big = [{"role": "user", "content": "a" * 50_000} for _ in range(10)]  # compresses to little
        assert (await http.post(f"/api/traces/{tid}/messages", json={"messages": big})).status_code == 200
    import os

    os.environ["FEDTEST_SIZE_KEY"] = fed.orgb.api_key
    c = PeerClient(
        Peer(alias="b", url=fed.orgb.url, credential="FEDTEST_SIZE_KEY"),
        FederationSettings(max_response_bytes=100_000, down_s=0.0),
    )
    try:
        with pytest.raises(ResourceExhausted, match="more than 100000 bytes"):
            await c.get(c.trace_path(tid, "/messages"), {"limit": 100})
        small = await c.get(c.trace_path(tid))  # the trace itself is small
        assert small["trace"]["id"] == tid
    finally:
        await c.close()
        os.environ.pop("FEDTEST_SIZE_KEY", None)


async def test_a_peer_that_never_answers_times_out(fed: Fed) -> None:
    import socket

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    c = client(f"http://127.0.0.1:{hole.getsockname()[1]}", timeout_s=0.3, read_retries=0)
    try:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="in time"):
            await c.get("/api/traces/x")
        assert time.monotonic() - started < 3
    finally:
        await c.close()
        hole.close()


async def test_an_answer_past_the_json_bound_is_a_clear_error(fed: Fed) -> None:
    """A peer answering JSON nested 5,000 levels deep is a peer that answered nothing usable:
    Unavailable (an error body so deep: its status alone), never the parser's RecursionError."""
    import asyncio

    deep = b"[" * 5000 + b"]" * 5000

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        status = b"200 OK" if head.startswith(b"GET") else b"422 Unprocessable Entity"
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n")
        writer.write(b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(deep) + deep)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    c = client(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", read_retries=0)
    try:
        with pytest.raises(Unavailable, match="not JSON within our bounds"):
            await c.get("/api/traces/x")
        with pytest.raises(InvalidArgument, match=r"p': invalid request$"):  # its message unread
            await c.post("/api/traces/x/messages", {})
    finally:
        await c.close()
        server.close()
        await server.wait_closed()
