"""What a failed or cancelled turn keeps: the turn engine's record of what the run streamed."""

from __future__ import annotations

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.errors import Cancelled
from agentmesh.libs.protojson import to_json
from agentmesh.services.orchestrator.turns import Partial
from agentmesh.trace.v1 import trace_pb2 as tp


def tool_in(call: str, name: str = "agent-invoke") -> ev.Event:
    return ev.Event(
        tool_input_available=ev.ToolInputAvailable(
            tool_call_id=call, tool_name=name, input=events.value({"x": call})
        )
    )


def tool_out(call: str) -> ev.Event:
    return ev.Event(
        tool_output_available=ev.ToolOutputAvailable(
            tool_call_id=call, tool_name="agent-invoke", output=events.value({"ok": True}), ok=True
        )
    )


def test_text_reasoning_and_tool_calls_are_kept_with_their_steps() -> None:
    partial = Partial()
    for event in (
        events.reasoning_delta("hm"),
        tool_in("a"),
        tool_in("b"),
        tool_out("a"),
        tool_out("b"),
        tool_in("c"),  # the next model step
        events.text_delta("half "),
        events.text_delta("an answer"),
    ):
        partial.see(event)
    msg = to_json(partial.message(9, tp.MESSAGE_STATUS_CANCELLED, Cancelled("stop")))
    assert msg["id"] == 9 and msg["status"] == "cancelled"
    assert msg["content"] == "half an answer" and msg["thinking"] == "hm"
    calls = msg["metadata"]["toolCalls"]
    assert [(c["id"], c["step"], c["ok"]) for c in calls] == [("a", 0, True), ("b", 0, True), ("c", 1, False)]
    assert calls[0]["input"] == {"x": "a"} and calls[0]["output"] == {"ok": True}
    assert calls[2]["output"]["ok"] is False, "a call the turn did not finish says so"
    assert msg["metadata"]["error"] == {"code": "cancelled", "message": "stop"}


def test_nothing_streamed_keeps_only_the_error() -> None:
    msg = to_json(Partial().message(1, tp.MESSAGE_STATUS_FAILED, Cancelled("x")))
    assert msg["content"] == "" and "toolCalls" not in msg["metadata"]


def test_a_call_cut_off_keeps_where_its_callee_ran_and_our_record() -> None:
    """A remote callee's `a2a-task-started` names the peer's trace and our record: the stored call keeps
    both under the names a finished call's result has (docs/federation.md#trace-ids-in-events-and-results)."""
    partial = Partial()
    started = ev.A2ATaskStarted(task_id="t1", tool_call_id="a", trace_id="@orgb/abc", local_trace_id="rec")
    for event in (tool_in("a"), ev.Event(a2a_task_started=started)):
        partial.see(event)
    msg = to_json(partial.message(3, tp.MESSAGE_STATUS_CANCELLED, Cancelled("stop")))
    meta = msg["metadata"]["toolCalls"][0]["metadata"]
    assert (meta["taskId"], meta["traceId"], meta["localTraceId"]) == ("t1", "@orgb/abc", "rec")
