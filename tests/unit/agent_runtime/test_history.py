"""Stored messages -> the Chat Completions history the model receives."""

from __future__ import annotations

import json

from agentmesh.libs import events
from agentmesh.services.agent_runtime.runner import history_to_openai, tool_text
from agentmesh.trace.v1 import trace_pb2 as tp


def msg(role: int, content: str = "", metadata: dict | None = None) -> tp.Message:
    m = tp.Message(role=role, content=content)  # type: ignore[arg-type]
    if metadata is not None:
        m.metadata.CopyFrom(events.struct(metadata))
    return m


def test_tool_calls_become_steps_before_the_final_text() -> None:
    calls = [
        {
            "id": "a",
            "name": "agent-invoke",
            "input": {"agentSlug": "coder"},
            "output": {"ok": True},
            "step": 0,
        },
        {"id": "b", "name": "clarify", "input": {}, "output": "plain", "step": 0},
        {"id": "c", "name": "delegate_task", "input": {"goal": "x"}, "output": None, "step": 1},
    ]
    history = history_to_openai(
        [
            msg(tp.MESSAGE_ROLE_SYSTEM, "be brief"),
            msg(tp.MESSAGE_ROLE_USER, "hi"),
            msg(tp.MESSAGE_ROLE_ASSISTANT, "done", {"toolCalls": calls}),
        ]
    )
    assert [h["role"] for h in history] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    first = history[2]["tool_calls"]
    assert [c["id"] for c in first] == ["a", "b"] and json.loads(first[0]["function"]["arguments"]) == {
        "agentSlug": "coder"
    }
    assert history[3] == {"role": "tool", "tool_call_id": "a", "content": '{"ok": true}'}
    assert history[4]["content"] == "plain" and history[6]["content"] == "null"
    assert history[-1] == {"role": "assistant", "content": "done"}


def test_an_assistant_message_without_text_adds_no_empty_turn() -> None:
    history = history_to_openai([msg(tp.MESSAGE_ROLE_USER, "q"), msg(tp.MESSAGE_ROLE_ASSISTANT, "")])
    assert history == [{"role": "user", "content": "q"}]
    assert tool_text({"ü": 1}) == '{"ü": 1}'
