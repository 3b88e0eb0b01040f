"""Fault modes and pacing, seen from the real openai client."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from agentmesh.mock_llm import MockLLM

USER: list[Any] = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def impatient(mock_llm: MockLLM) -> AsyncIterator[openai.AsyncOpenAI]:
    """A client whose read timeout is short, for the stall faults."""
    async with openai.AsyncOpenAI(base_url=mock_llm.base_url, api_key="x", max_retries=0, timeout=0.5) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
async def test_http_429(mock_llm: MockLLM, client: openai.AsyncOpenAI, stream: bool) -> None:
    mock_llm.set_rules([{"fault": "http_429"}])
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model="mock-gpt", messages=USER, stream=stream)
    assert caught.value.code == "rate_limit_exceeded"


@pytest.mark.parametrize("stream", [False, True])
async def test_http_500(mock_llm: MockLLM, client: openai.AsyncOpenAI, stream: bool) -> None:
    mock_llm.set_rules([{"fault": "http_500"}])
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model="mock-gpt", messages=USER, stream=stream)


async def test_stall_after_first_chunk(mock_llm: MockLLM, impatient: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules([{"fault": "stall", "text": "never finished"}])
    stream = await impatient.chat.completions.create(model="mock-gpt", messages=USER, stream=True)
    received = []
    with pytest.raises(openai.APITimeoutError):
        async for chunk in stream:
            received.append(chunk)
    assert len(received) == 1 and received[0].choices[0].delta.role == "assistant"
    await stream.close()
    await mock_llm.wait_idle()  # the server saw the client go away
    assert mock_llm.stats()["in_flight"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_stall_before_headers(mock_llm: MockLLM, impatient: openai.AsyncOpenAI, stream: bool) -> None:
    mock_llm.set_rules([{"fault": "stall_before"}])
    with pytest.raises(openai.APITimeoutError):
        await impatient.chat.completions.create(model="mock-gpt", messages=USER, stream=stream)
    assert mock_llm.stats()["total"] == 1
    await mock_llm.wait_idle()  # the server saw the client go away
    assert mock_llm.stats()["in_flight"] == 0


async def test_cut_stream(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules([{"fault": "cut", "text": "one two three four five six seven"}])
    stream = await client.chat.completions.create(model="mock-gpt", messages=USER, stream=True)
    received = []
    with pytest.raises(openai.APIConnectionError):
        async for chunk in stream:
            received.append(chunk)
    assert "".join(c.choices[0].delta.content or "" for c in received) == "one two three "
    assert all(c.choices[0].finish_reason is None for c in received)


async def test_cut_not_streamed(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules([{"fault": "cut", "text": "one two three"}])
    with pytest.raises(openai.APIConnectionError):
        await client.chat.completions.create(model="mock-gpt", messages=USER)


async def test_pacing_yields_every_token(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules([{"tokens": 20, "ttft_ms": 100, "tokens_per_second": 100}])
    started = time.monotonic()
    stream = await client.chat.completions.create(model="mock-gpt", messages=USER, stream=True)
    chunks = [c async for c in stream]
    elapsed = time.monotonic() - started
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 20
    # 100 ms to the first token, then 19 gaps of 10 ms: a loose lower bound only.
    assert elapsed >= 0.25


async def test_global_timing_comes_from_the_server(mock_llm: MockLLM) -> None:
    mock_llm.set_rules({"ttft_ms": 300, "tokens_per_second": 7, "rules": [{"text": "x", "ttft_ms": 5}]})
    rule = mock_llm.rules.rules[0]
    # The session server was built with ttft_ms=0 and tokens_per_second=0: those win over the document.
    assert mock_llm.timing(rule) == (0.005, 0.0)
    assert mock_llm.timing(mock_llm.rules.default) == (0.0, 0.0)
    assert MockLLM(mock_llm.rules).timing(mock_llm.rules.default) == (0.3, 7.0)
