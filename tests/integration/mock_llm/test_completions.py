"""The Chat Completions wire format, checked through the real openai client."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageFunctionToolCall

from agentmesh.mock_llm import MockLLM

USER: list[Any] = [{"role": "user", "content": "hello there model"}]


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def tool(name: str) -> Any:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


async def collect(client: openai.AsyncOpenAI, **kwargs: Any) -> list[ChatCompletionChunk]:
    kwargs.setdefault("model", "mock-gpt")
    kwargs.setdefault("messages", USER)
    stream = await client.chat.completions.create(stream=True, **kwargs)
    return [chunk async for chunk in stream]


def text_of(chunks: list[ChatCompletionChunk]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def arguments(call: Any) -> str:
    """The arguments of a function tool call of a final message."""
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    return call.function.arguments


def finish_of(chunks: list[ChatCompletionChunk]) -> str | None:
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    return finishes[0]


async def test_streamed_text_without_usage(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules([{"text": "alpha beta  gamma\ndelta"}])
    chunks = await collect(client, model="any-model")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text_of(chunks) == "alpha beta  gamma\ndelta"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 4
    assert finish_of(chunks) == "stop"
    assert all(c.usage is None and c.choices for c in chunks)
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert all(c.model == "any-model" and c.object == "chat.completion.chunk" for c in chunks)


async def test_streamed_text_with_usage(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules([{"text": "one two three"}])
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "count to three please"},
    ]
    chunks = await collect(client, messages=messages, stream_options={"include_usage": True})
    assert text_of(chunks) == "one two three"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (6, 3, 9)
    assert all(c.usage is None for c in chunks[:-1])


async def test_not_streamed_text(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules([{"user": r"name is (?P<name>\w+)", "text": "Hi {name}, you wrote: {user}"}])
    reply = await client.chat.completions.create(
        model="mock-gpt", messages=[{"role": "user", "content": "my name is Ada"}]
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.content == "Hi Ada, you wrote: my name is Ada"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens == 4


async def test_default_reply_echoes(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(model="mock-gpt", messages=USER)
    assert reply.choices[0].message.content == "You said: hello there model"


async def test_tool_call_arguments_split_across_chunks(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    args = {"agentSlug": "coder", "input": "write a parser for {user}", "depth": 2, "tags": ["a", "b c"]}
    mock_llm.set_rules([{"tool_calls": [{"name": "agent-invoke", "arguments": args}]}])
    chunks = await collect(client, tools=[tool("agent-invoke")])
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first, rest = pieces[0], pieces[1:]
    assert (
        first.index == 0
        and first.id is not None
        and first.id.startswith("call_")
        and first.type == "function"
    )
    assert first.function is not None and first.function.name == "agent-invoke"
    assert len(rest) >= 4 and all(p.id is None and p.function and p.function.arguments for p in rest)
    joined = "".join(p.function.arguments or "" for p in pieces if p.function)
    assert json.loads(joined) == {**args, "input": "write a parser for hello there model"}
    assert finish_of(chunks) == "tool_calls"

    async with client.chat.completions.stream(
        model="mock-gpt", messages=USER, tools=[tool("agent-invoke")]
    ) as stream:
        final = await stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    assert json.loads(arguments(calls[0]))["input"] == "write a parser for hello there model"


async def test_two_parallel_tool_calls(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    calls = [
        {"name": "lookup", "arguments": {"q": "first thing to look up"}},
        {"name": "lookup", "arguments": {"q": "second thing"}},
    ]
    mock_llm.set_rules([{"text": "Let me check.", "tool_calls": calls}])
    chunks = await collect(client, tools=[tool("lookup")])
    assert text_of(chunks) == "Let me check."
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    heads = [p for p in pieces if p.id]
    assert [h.index for h in heads] == [0, 1] and heads[0].id != heads[1].id
    args = {
        i: "".join(p.function.arguments or "" for p in pieces if p.index == i and p.function) for i in (0, 1)
    }
    assert json.loads(args[0]) == {"q": "first thing to look up"} and json.loads(args[1]) == {
        "q": "second thing"
    }

    reply = await client.chat.completions.create(model="mock-gpt", messages=USER, tools=[tool("lookup")])
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    assert message.tool_calls is not None
    assert [json.loads(arguments(c))["q"] for c in message.tool_calls] == [
        "first thing to look up",
        "second thing",
    ]


async def test_template_escaping_keeps_arguments_valid_json(
    mock_llm: MockLLM, client: openai.AsyncOpenAI
) -> None:
    mock_llm.set_rules(
        [
            {
                "user": r"run: (?P<cmd>.*)",
                "tool_calls": [{"name": "shell", "arguments": {"cmd": "{cmd}", "raw": "{user}"}}],
            }
        ]
    )
    nasty = "echo \"quoted\" \\ back\\slash\n{braces} and 'single'\ttab"
    reply = await client.chat.completions.create(
        model="mock-gpt", messages=user(f"run: {nasty}"), tools=[tool("shell")]
    )
    calls = reply.choices[0].message.tool_calls
    assert calls is not None
    assert json.loads(arguments(calls[0])) == {"cmd": nasty, "raw": f"run: {nasty}"}


async def test_after_tool_rules(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules(
        [
            {
                "after_tool": False,
                "tool_calls": [{"name": "t", "arguments": {}}, {"name": "t", "arguments": {}}],
            },
            {
                "after_tool": True,
                "text": "all: {tool_results} | first: {tool_result_1} | second: {tool_result_2}",
            },
        ]
    )
    first = await client.chat.completions.create(model="mock-gpt", messages=USER, tools=[tool("t")])
    calls = first.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 2
    messages: list[Any] = [
        *USER,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": "R1"},
        {"role": "tool", "tool_call_id": calls[1].id, "content": [{"type": "text", "text": "R2"}]},
    ]
    second = await client.chat.completions.create(model="mock-gpt", messages=messages, tools=[tool("t")])
    assert second.choices[0].message.content == "all: R1\nR2 | first: R1 | second: R2"


async def test_length_finish_on_max_tokens(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules([{"text": "w1 w2 w3 w4 w5 w6 w7 w8"}])
    chunks = await collect(client, max_tokens=3, stream_options={"include_usage": True})
    assert text_of(chunks) == "w1 w2 w3 "
    assert finish_of(chunks) == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3

    reply = await client.chat.completions.create(model="mock-gpt", messages=USER, max_completion_tokens=5)
    assert (
        reply.choices[0].message.content == "w1 w2 w3 w4 w5 " and reply.choices[0].finish_reason == "length"
    )

    whole = await client.chat.completions.create(model="mock-gpt", messages=USER, max_tokens=8)
    assert whole.choices[0].finish_reason == "stop"


async def test_repeat_and_tokens(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules(
        [{"user": "long", "text": "la di da.", "repeat": 3}, {"user": "filler", "tokens": 2000}]
    )
    reply = await client.chat.completions.create(
        model="mock-gpt", messages=[{"role": "user", "content": "long"}]
    )
    assert reply.choices[0].message.content == "la di da. la di da. la di da."
    chunks = await collect(
        client, messages=[{"role": "user", "content": "filler"}], stream_options={"include_usage": True}
    )
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 2000
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2000


async def test_matching_on_model_system_and_tools(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules(
        [
            {"model": "gpt-4o", "text": "exact model"},
            {"model": "mock-.*", "system": "(?i)pirate", "text": "arr"},
            {"tools_include": "search", "text": "has search"},
            {"tool_calls": [{"name": "missing", "arguments": {}}]},
        ]
    )

    async def ask(model: str, system: str = "", tools: list[Any] | None = None) -> str | None:
        messages: list[Any] = [{"role": "system", "content": system}, *USER] if system else USER
        reply = await client.chat.completions.create(
            model=model, messages=messages, tools=tools or openai.omit
        )
        return reply.choices[0].message.content

    assert await ask("gpt-4o") == "exact model"
    assert await ask("gpt-4o-mini") == "You said: hello there model"
    assert await ask("mock-gpt", "You are a PIRATE") == "arr"
    assert await ask("mock-gpt", "You are a PIRATE", [tool("search")]) == "arr"
    assert await ask("mock-gpt", "", [tool("search")]) == "has search"
    # A tool-calling rule is skipped when the request does not offer the tool.
    assert await ask("mock-gpt", "", [tool("other")]) == "You said: hello there model"


async def test_times_limits_a_rule(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules([{"fault": "http_429", "times": 1}, {"text": "second try works"}])
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model="mock-gpt", messages=USER)
    reply = await client.chat.completions.create(model="mock-gpt", messages=USER)
    assert reply.choices[0].message.content == "second try works"


async def test_models_endpoint(mock_llm: MockLLM, client: openai.AsyncOpenAI) -> None:
    mock_llm.set_rules({"models": ["mock-gpt", "mock-mini"], "rules": []})
    models = [m.id async for m in client.models.list()]
    assert models == ["mock-gpt", "mock-mini"]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        (
            [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_1", "content": "r"}],
            "messages[1].role",
        ),
        (
            [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "t", "arguments": "{}"}}
                    ],
                },
                {"role": "user", "content": "y"},
            ],
            "messages[2].role",
        ),
    ],
)
async def test_invalid_requests_are_400(
    mock_llm: MockLLM, client: openai.AsyncOpenAI, messages: list[Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="mock-gpt", messages=messages)
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error" and body["param"] == param
    assert mock_llm.stats()["total"] == 0


async def test_title_variable_says_what_a_message_is_about(
    mock_llm: MockLLM, client: openai.AsyncOpenAI
) -> None:
    mock_llm.set_rules({"rules": [{"text": "{title}"}]})
    cases = {
        "Please help me plan a trip to Lisbon in May with my family\nand more": "Plan trip Lisbon May family",
        "hi there": "Hi there",
        "split this into subtasks: a todo app": "Split this into subtasks todo app",
    }
    for text, title in cases.items():
        reply = await client.chat.completions.create(model="mock-gpt", messages=user(text))
        assert reply.choices[0].message.content == title
