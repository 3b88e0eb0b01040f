"""agentmesh/mock_llm/demo_rules.yaml drives the demo agents of services/trace/demo_catalog.yaml."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import yaml

from agentmesh.libs.config import MeshSettings
from agentmesh.mock_llm import DEMO_RULES, MockLLM

CATALOG = {a["slug"]: a for a in yaml.safe_load(MeshSettings().catalog.read_text())["agents"]}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("agent-invoke", "delegate_task", "delegate_parallel")
]


@pytest.fixture
def demo(mock_llm: MockLLM) -> MockLLM:
    mock_llm.set_rules(DEMO_RULES.read_text())
    return mock_llm


def messages_for(slug: str, text: str) -> list[Any]:
    return [{"role": "system", "content": CATALOG[slug]["systemPrompt"]}, {"role": "user", "content": text}]


async def turn(client: openai.AsyncOpenAI, messages: list[Any], tools: list[Any] | None = None) -> Any:
    """One streamed model turn, reassembled by the openai client's stream helper."""
    async with client.chat.completions.stream(
        model="mock-gpt", messages=messages, tools=tools or openai.omit
    ) as stream:
        return (await stream.get_final_completion()).choices[0]


async def test_demo_rules_have_pacing(demo: MockLLM) -> None:
    assert (demo.rules.ttft_ms, demo.rules.tokens_per_second) == (50, 200)


async def test_general_asks_the_coder(demo: MockLLM, client: openai.AsyncOpenAI) -> None:
    messages = messages_for("general", "Please ask the coding assistant to write fizzbuzz in Python")
    first = await turn(client, messages, TOOLS)
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    assert call.function.name == "agent-invoke"
    assert json.loads(call.function.arguments) == {
        "agentSlug": "coder",
        "input": "to write fizzbuzz in Python",
    }

    coder = await turn(client, messages_for("coder", "to write fizzbuzz in Python"))
    assert coder.finish_reason == "stop"
    assert "```python\ndef fizzbuzz(n: int) -> str:" in coder.message.content

    # The runtime hands agent-invoke's result back as JSON; the answer carries the callee's markdown.
    result = {"output": coder.message.content, "ok": True, "taskId": "task-1", "traceId": "trace-1"}
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    final = await turn(client, messages, TOOLS)
    assert final.message.content == f"The coding assistant replied:\n\n{coder.message.content}"


async def test_the_coder_answers_any_task(demo: MockLLM, client: openai.AsyncOpenAI) -> None:
    coder = await turn(client, messages_for("coder", "Write code for: a todo app"))
    assert coder.message.content.startswith("A first piece of code for a todo app:\n\n```python\n")


async def test_general_splits_into_subtasks(demo: MockLLM, client: openai.AsyncOpenAI) -> None:
    messages = messages_for("general", "split this into subtasks: a todo app")
    first = await turn(client, messages, TOOLS)
    (call,) = first.message.tool_calls
    assert call.function.name == "delegate_parallel"
    tasks = json.loads(call.function.arguments)["tasks"]
    assert tasks == [
        {"goal": "Research: a todo app", "agentSlug": "researcher"},
        {"goal": "Outline: a todo app"},
        {"goal": "Write code for: a todo app", "agentSlug": "coder"},
    ]

    research = await turn(client, messages_for("researcher", tasks[0]["goal"]))
    assert research.message.content.startswith("The essentials of a todo app:")
    outline = await turn(client, [{"role": "user", "content": tasks[1]["goal"]}])
    assert outline.message.content.startswith("An outline for a todo app in three steps:\n1. ")

    # delegate_parallel's result as the runtime returns it: the summaries come back as a list.
    results = [
        {"id": "s1", "name": "Research Assistant", "goal": tasks[0]["goal"], "status": "completed",
         "summary": research.message.content},
        {"id": "s2", "name": "General Assistant (clone)", "goal": tasks[1]["goal"], "status": "completed",
         "summary": outline.message.content},
        {"id": "s3", "name": "Coding Assistant", "goal": tasks[2]["goal"], "status": "failed",
         "error": "MODEL_ERROR: the model failed"},
    ]  # fmt: skip
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": True, "results": results})},
    ]
    final = await turn(client, messages, TOOLS)
    assert final.finish_reason == "stop"
    assert final.message.content == (
        'The three subtasks for "a todo app" are done:\n\n'
        "- **Research Assistant**: The essentials of a todo app: it is well documented, and what matters "
        "most is its purpose, its main trade-offs and the usual way to get started.\n"
        "- **General Assistant (clone)**: An outline for a todo app in three steps: 1. Goal and scope "
        "2. Main parts 3. Next steps\n"
        "- **Coding Assistant**: failed: MODEL_ERROR: the model failed\n\n"
        "Together they give the research, an outline and a first piece of code."
    )


async def test_general_researches_in_the_background(demo: MockLLM, client: openai.AsyncOpenAI) -> None:
    tools = TOOLS + [
        {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
        for name in ("subagent_status", "subagent_wait", "subagent_stop")
    ]
    messages = messages_for("general", "research in the background: vector databases")
    first = await turn(client, messages, tools)
    (call,) = first.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "delegate_task",
        {"goal": "Research: vector databases", "agentSlug": "researcher", "background": True},
    )
    handle = {"id": "s1", "traceId": "t1", "name": "Research Assistant", "goal": "Research: vector databases"}
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"ok": True, "background": True, "handles": [handle]})},
    ]  # fmt: skip
    started = await turn(client, messages, tools)
    assert started.message.content.startswith(
        "The research runs in the background:\n\n- **Research Assistant**: started (s1): Research: vector"
    ), started.message.content
    for ask, tool in (
        ("how is the research going?", "subagent_status"),
        ("wait for the research", "subagent_wait"),
    ):
        asked = await turn(client, messages_for("general", ask), tools)
        (follow,) = asked.message.tool_calls
        assert follow.function.name == tool
    running = {**handle, "status": "running", "latest": "The essentials of vector"}
    status = [
        *messages_for("general", "how is the research going?"),
        {"role": "assistant", "content": None, "tool_calls": [follow.model_dump(exclude_none=True)]},
        {
            "role": "tool",
            "tool_call_id": follow.id,
            "content": json.dumps({"ok": True, "subagents": [running]}),
        },
    ]
    report = await turn(client, status, tools)
    assert report.message.content == (
        "Your background research:\n\n- **Research Assistant**: running: The essentials of vector"
    )


async def test_anything_else_is_echoed(demo: MockLLM, client: openai.AsyncOpenAI) -> None:
    reply = await turn(client, messages_for("general", "what is the weather?"), TOOLS)
    assert reply.message.content.startswith('Hello! You said: "what is the weather?"')
    assert reply.message.tool_calls in (None, [])


async def test_the_demo_model_titles_a_chat(demo: MockLLM, client: openai.AsyncOpenAI) -> None:
    """Asked for a title (the system prompt starts "Title this conversation"), it answers a few words
    of the chat's first message: what the chat is about, not the whole message."""
    messages = [
        {"role": "system", "content": "Title this conversation in at most six words."},
        {"role": "user", "content": "please ask the coding assistant to write fizzbuzz"},
    ]
    assert (await turn(client, messages)).message.content == "Coding assistant write fizzbuzz"
