"""A scripted model server on a loopback port, shared by the session; each test installs its own rules."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from agentmesh.mock_llm import MockLLM


@pytest.fixture(scope="session")
async def mock_llm_server() -> AsyncIterator[MockLLM]:
    server = MockLLM(ttft_ms=0, tokens_per_second=0)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def mock_llm(mock_llm_server: MockLLM) -> MockLLM:
    """The shared server with a cleared request log and stats and the default rules."""
    mock_llm_server.reset()
    mock_llm_server.set_rules({})
    return mock_llm_server


@pytest.fixture
async def client(mock_llm: MockLLM) -> AsyncIterator[openai.AsyncOpenAI]:
    """The real OpenAI client pointed at the scripted server."""
    async with openai.AsyncOpenAI(base_url=mock_llm.base_url, api_key="x", max_retries=0, timeout=10) as c:
        yield c
