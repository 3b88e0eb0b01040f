"""The /_mock endpoints, the Python API and `python -m agentmesh.mock_llm`."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from typing import Any

import httpx
import openai
import pytest

from agentmesh.mock_llm import MockLLM, RulesError, parse_rules

USER: list[Any] = [{"role": "user", "content": "hello"}]


async def test_requests_log_and_reset(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules([{"name": "greeter", "text": "hi"}])
    for i in range(3):
        await client.chat.completions.create(
            model="mock-gpt", messages=[{"role": "user", "content": f"m{i}"}]
        )
    async with httpx.AsyncClient(base_url=mock_llm.url) as http:
        log = (await http.get("/_mock/requests")).json()["requests"]
        assert [e["index"] for e in log] == [0, 1, 2]
        assert [e["body"]["messages"][0]["content"] for e in log] == ["m0", "m1", "m2"]
        assert all(e["rule"] == "greeter" for e in log)
        assert log[0]["received_at"] <= log[1]["received_at"] <= log[2]["received_at"]
        assert (await http.get("/_mock/stats")).json() == {"in_flight": 0, "max_in_flight": 1, "total": 3}
        assert (await http.post("/_mock/reset")).status_code == 200
        assert (await http.get("/_mock/requests")).json() == {"requests": []}
        assert (await http.get("/_mock/stats")).json() == {"in_flight": 0, "max_in_flight": 0, "total": 0}
    assert mock_llm.requests() == []


async def test_max_in_flight_counts_concurrent_requests(
    mock_llm: MockLLM, client: openai.AsyncOpenAI
) -> None:
    # The barrier holds each reply until four requests of the rule wait at once.
    mock_llm.set_rules([{"text": "together", "barrier": 4, "barrier_timeout_ms": 5000}])
    replies = await asyncio.gather(
        *(
            client.chat.completions.create(model="mock-gpt", messages=USER, stream=s)
            for s in (True, False) * 2
        )
    )
    assert len(replies) == 4
    assert mock_llm.stats() == {"in_flight": 0, "max_in_flight": 4, "total": 4}


async def test_wait_requests(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules([{"fault": "stall_before"}])
    call = asyncio.create_task(client.chat.completions.create(model="mock-gpt", messages=USER))
    bodies = await mock_llm.wait_requests(1)
    assert bodies[0]["messages"] == USER
    assert mock_llm.stats()["in_flight"] == 1
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await mock_llm.wait_idle()
    assert mock_llm.stats()["in_flight"] == 0


async def test_post_rules(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    yaml_rules = "rules:\n  - user: ping\n    text: pong\ndefault:\n  text: 'default for {user}'\n"
    async with httpx.AsyncClient(base_url=mock_llm.url) as http:
        ok = await http.post("/_mock/rules", content=yaml_rules)
        assert ok.json() == {"rules": 1}
        bad = await http.post("/_mock/rules", content='{"rules": [{"user": "(unclosed", "text": "x"}]}')
        assert bad.status_code == 400 and "regular expression" in bad.json()["error"]["message"]
    ping = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "ping"}])
    other = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "other"}])
    assert ping.choices[0].message.content == "pong"
    assert other.choices[0].message.content == "default for other"


async def test_invalid_json_body(mock_llm: MockLLM) -> None:
    async with httpx.AsyncClient(base_url=mock_llm.base_url) as http:
        response = await http.post("/chat/completions", content=b"{not json")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ([{"user": "x"}], "needs a reply"),
        ([{"text": "x", "colour": "red"}], "unknown keys"),
        ([{"fault": "explode"}], "fault must be one of"),
        ([{"text": "{user.name}"}], "placeholders"),
        ([{"text": "{unclosed"}], "bad template"),
        ([{"tool_calls": [{"name": "t", "arguments": ["not", "a", "mapping"]}]}], "mapping"),
        ({"rules": [], "default": {"user": "x", "text": "y"}}, "default takes a reply only"),
        ("- [unbalanced", "not valid YAML"),
    ],
)
def test_rules_errors(doc: object, fragment: str) -> None:
    with pytest.raises(RulesError, match=fragment):
        parse_rules(doc)  # type: ignore[arg-type]


async def test_start_on_busy_port_fails() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError):
            await MockLLM().start(port=busy.getsockname()[1])


async def test_module_entry_point_serves_until_sigterm() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agentmesh.mock_llm",
        "--port",
        str(port),
        "--ttft-ms",
        "0",
        "--tokens-per-second",
        "0",
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "AGENTMESH_LOG_JSON": "false"},
    )
    assert proc.stderr is not None
    try:

        async def serving() -> None:
            while b"mock LLM serving" not in await proc.stderr.readline():  # type: ignore[union-attr]
                assert proc.returncode is None

        await asyncio.wait_for(serving(), 20)
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
        ) as c:
            reply = await c.chat.completions.create(
                model="mock-gpt", messages=[{"role": "user", "content": "hi"}]
            )
        assert (
            reply.choices[0].message.content is not None
            and 'You said: "hi"' in reply.choices[0].message.content
        )
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
