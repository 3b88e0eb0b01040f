"""The runtime's model client (services/agent_runtime/llm.py) against the scripted model server behind
a loopback relay that hangs up on chosen connections before they are answered: what a server that
closed a pooled keep-alive connection looks like to a client that reuses it. Such a request is sent
again on a new connection, up to three sends; a server that keeps hanging up fails the call with a
clear error."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlparse

import pytest
import uvicorn

from agentmesh.libs.config import LLMSettings
from agentmesh.libs.errors import ModelError
from agentmesh.mock_llm import MockLLM
from agentmesh.services.agent_runtime.llm import KEEPALIVE_S, LLM

ROOT = Path(__file__).resolve().parents[3]


class Relay:
    """Forwards connections to the model server; the first `hang_ups` connections are closed as soon
    as their request arrives, unanswered."""

    def __init__(self, target: str, hang_ups: int) -> None:
        url = urlparse(target)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.path = url.path
        self.hang_ups = hang_ups
        self.connections = 0

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.connections <= self.hang_ups:
            await reader.read(1)  # the request came: hang up without a word
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            yield f"http://127.0.0.1:{port}{self.path}"


@pytest.fixture
async def mock() -> AsyncIterator[MockLLM]:
    server = MockLLM(ttft_ms=0, tokens_per_second=0)
    await server.start()
    server.set_rules({"rules": [], "default": {"text": "still here"}})
    yield server
    await server.stop()


async def _ask(base_url: str) -> str:
    llm = LLM(LLMSettings(base_url=base_url, api_key="x", request_timeout_s=10))
    text: list[str] = []
    try:
        step = await asyncio.wait_for(
            llm.step(
                model="mock-gpt",
                messages=[{"role": "user", "content": "hi"}],
                tools=[],
                max_tokens=50,
                on_text=text.append,
                on_reasoning=text.append,
            ),
            15,
        )
    finally:
        await llm.close()
    assert "".join(text) == step.content
    return step.content


@pytest.mark.parametrize("hang_ups", [1, 2])
async def test_a_request_the_server_hung_up_on_is_sent_again(mock: MockLLM, hang_ups: int) -> None:
    relay = Relay(mock.base_url, hang_ups=hang_ups)
    async with relay.running() as url:
        assert await _ask(url) == "still here"
    assert relay.connections == hang_ups + 1 and len(mock.requests()) == 1


def test_pooled_connections_go_before_a_five_second_server_keepalive() -> None:
    """uvicorn (the scripted server, and many OpenAI-compatible ones) closes a connection idle 5 s:
    the client lets it go before, instead of sending on it as it closes."""
    # (no app: only the default keep-alive is read)
    assert KEEPALIVE_S < uvicorn.Config(app=cast(Any, None)).timeout_keep_alive == 5


async def test_a_server_that_keeps_hanging_up_fails_the_call_clearly(mock: MockLLM) -> None:
    relay = Relay(mock.base_url, hang_ups=10)
    async with relay.running() as url:
        with pytest.raises(ModelError, match="closed the connection"):
            await _ask(url)
    assert relay.connections == 3 and mock.requests() == []  # two retries, no more


def test_the_client_sets_up_its_chat_resources_at_start_not_in_the_first_turn() -> None:
    """openai imports the chat resources (modules and models, tens of ms) on first use: LLM() does it,
    so a process's first turn does not wait on it."""
    code = (
        "import asyncio, sys\n"
        "from agentmesh.libs.config import LLMSettings\n"
        "from agentmesh.services.agent_runtime.llm import LLM\n"
        "name = 'openai.resources.chat.completions'\n"
        "before = name in sys.modules\n"
        "async def main():\n"
        "    llm = LLM(LLMSettings())\n"
        "    print(before, name in sys.modules)\n"
        "    await llm.close()\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["False", "True"], out.stderr


async def test_the_model_server_gets_the_messages_and_tools_as_given(mock: MockLLM) -> None:
    """The body carries the run's messages and tools as they are (they skip the client's parameter
    transform), with the named parameters beside them."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"ok\": true}"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "lookup", "description": "finds",
              "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]  # fmt: skip
    llm = LLM(LLMSettings(base_url=mock.base_url, api_key="x", request_timeout_s=10))
    try:
        step = await llm.step(
            model="mock-gpt", messages=messages, tools=tools, max_tokens=7,
            on_text=lambda _: None, on_reasoning=lambda _: None,
        )  # fmt: skip
    finally:
        await llm.close()
    assert step.content == "still here"
    (body,) = mock.requests()
    assert (body["messages"], body["tools"]) == (messages, tools)
    assert (body["model"], body["max_tokens"], body["stream"]) == ("mock-gpt", 7, True)
    assert body["stream_options"] == {"include_usage": True}
