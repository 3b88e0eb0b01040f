"""The one mapping of our buffer's events to A2A events (live and replayed alike), the task states both
ways, and an agent's card."""

from __future__ import annotations

from a2a.types import a2a_pb2 as a2a

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.gateway.a2a.cards import agent_card
from agentmesh.gateway.a2a.events import to_a2a
from agentmesh.libs import events
from agentmesh.libs.a2a import FINAL_A2A_STATES, from_a2a_state, to_a2a_state
from agentmesh.libs.errors import Cancelled, ModelError
from agentmesh.trace.v1 import trace_pb2 as tp


def _at(event: ev.Event, offset: str) -> ev.Event:
    event.offset = offset
    return event


def test_text_opens_then_appends_to_the_reply_artifact_with_its_offset() -> None:
    first = to_a2a(_at(events.text_delta("he"), "1-0"), "t", "c", first_text=True)
    later = to_a2a(_at(events.text_delta("llo"), "2-0"), "t", "c")
    assert isinstance(first, a2a.TaskArtifactUpdateEvent) and isinstance(later, a2a.TaskArtifactUpdateEvent)
    assert (first.append, later.append) == (False, True)
    assert first.artifact.artifact_id == later.artifact.artifact_id == "response"
    assert [first.metadata["offset"], later.metadata["offset"]] == ["1-0", "2-0"]
    assert (first.task_id, first.context_id) == ("t", "c")


def test_terminal_events_end_the_task() -> None:
    done = to_a2a(_at(events.done(), "9-0"), "t", "c")
    cancelled = to_a2a(_at(events.error(Cancelled("stop")), "9-1"), "t", "c")
    failed = to_a2a(_at(events.error(ModelError("broke")), "9-2"), "t", "c")
    assert isinstance(done, a2a.TaskStatusUpdateEvent) and done.status.state == a2a.TASK_STATE_COMPLETED
    assert isinstance(cancelled, a2a.TaskStatusUpdateEvent)
    assert cancelled.status.state == a2a.TASK_STATE_CANCELED
    assert isinstance(failed, a2a.TaskStatusUpdateEvent) and failed.status.state == a2a.TASK_STATE_FAILED
    assert failed.status.message.parts[0].text == "broke" and failed.metadata["code"] == "model_error"


def test_usage_rides_on_the_finish_and_the_rest_is_left_out() -> None:
    finish = ev.Event(finish=ev.TurnFinish(usage=ev.Usage(input_tokens=3, output_tokens=5), model="m"))
    out = to_a2a(_at(finish, "5-0"), "t", "c")
    assert isinstance(out, a2a.TaskStatusUpdateEvent) and out.status.state == a2a.TASK_STATE_WORKING
    assert out.metadata["usage"]["outputTokens"] == 5
    assert to_a2a(events.reasoning_delta("hmm"), "t", "c") is None
    tool = ev.Event(tool_input_available=ev.ToolInputAvailable(tool_call_id="x", tool_name="agent-invoke"))
    assert to_a2a(tool, "t", "c") is None


def test_states_both_ways() -> None:
    for state in tp.TaskState.values():
        if state:
            assert from_a2a_state(to_a2a_state(state)) == state
    assert from_a2a_state(a2a.TASK_STATE_AUTH_REQUIRED) == tp.TASK_STATE_INPUT_REQUIRED
    assert {to_a2a_state(s) for s in (tp.TASK_STATE_COMPLETED, tp.TASK_STATE_CANCELED)} <= FINAL_A2A_STATES
    assert to_a2a_state(tp.TASK_STATE_WORKING) not in FINAL_A2A_STATES


def test_card() -> None:
    agent = ap.Agent(slug="coder", name="Coder", description="codes", version=4, public=True)
    card = agent_card(agent, "https://mesh.example", "mesh.example:50055")
    assert (card.name, card.version, card.capabilities.streaming) == ("Coder", "4", True)
    assert [(i.protocol_binding, i.protocol_version, i.url, i.tenant) for i in card.supported_interfaces] == [
        ("JSONRPC", "1.0", "https://mesh.example/a2a/coder", ""),
        ("GRPC", "1.0", "mesh.example:50055", "coder"),
        ("JSONRPC", "0.3", "https://mesh.example/a2a/coder", ""),
    ]
    assert card.security_schemes["bearer"].http_auth_security_scheme.scheme == "Bearer"
    assert [i.protocol_binding for i in agent_card(agent, "https://m", "").supported_interfaces] == [
        "JSONRPC",
        "JSONRPC",
    ]
