"""`{tool_text}`: the scripted model's replies use a tool's result as prose, never as its JSON."""

from __future__ import annotations

import json

from agentmesh.mock_llm.rules import BRIEF_CHARS, ChatRequestView, brief, build_reply, parse_rule, readable

CALLEE = "Here it is:\n\n```python\nprint('hi')\n```\n\nDone."


def test_an_agent_invoke_reply_is_the_callees_markdown() -> None:
    result = {"output": CALLEE, "ok": True, "taskId": "t-1", "traceId": "tr-1", "remote": True}
    assert readable(json.dumps(result)) == CALLEE


def test_a_batch_is_a_markdown_list_of_short_summaries() -> None:
    results = [
        {"id": "s1", "name": "Coding Assistant", "status": "completed", "summary": CALLEE},
        {"id": "s2", "name": "Helper", "status": "failed", "error": "TIMEOUT: too slow"},
        {"id": "s3", "name": "Other", "status": "cancelled", "error": "cancelled"},
        {"output": "an unnamed callee's answer", "ok": True, "taskId": "t"},
    ]
    assert readable(json.dumps({"ok": True, "results": results, "summary": {"total": 4}})) == (
        "- **Coding Assistant**: Here it is\n"
        "- **Helper**: failed: TIMEOUT: too slow\n"
        "- **Other**: cancelled\n"
        "- an unnamed callee's answer"
    )


def test_failures_and_other_results_read_as_text() -> None:
    assert readable(json.dumps({"ok": False, "error": "unknown agent", "code": "not_found"})) == (
        "failed: unknown agent"
    )
    assert readable(json.dumps({"output": "", "ok": False, "error": "boom"})) == "failed: boom"
    assert readable("plain text stays") == "plain text stays"
    assert readable(json.dumps({"count": 2, "names": ["a", "b"]})) == "- **count**: 2\n- **names**: a, b"


def test_brief_is_the_first_paragraph_on_one_line() -> None:
    assert brief("Line one\nline two\n\nSecond paragraph") == "Line one line two"
    assert brief("```\ncode\n```\nafter") == "code"
    long = " ".join(["word"] * 100)
    assert len(brief(long)) <= BRIEF_CHARS and brief(long).endswith("…")


def test_templates_get_tool_text_and_keep_the_raw_results() -> None:
    result = json.dumps({"output": CALLEE, "ok": True, "taskId": "t-1"})
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
            {"role": "tool", "tool_call_id": "c1", "content": result},
        ],
    }
    view = ChatRequestView.of(body)
    rule = parse_rule({"text": "{tool_text}|{tool_text_1}|{tool_results}"}, "rule")
    assert build_reply(rule, view.variables({})).text == f"{CALLEE}|{CALLEE}|{result}"
