"""What a turn stores before it runs, the same wherever it is stored (the orchestrator's turn engine,
a subagent batch's rows): its user message, its assistant placeholder (the anchor) and its `start`."""

from __future__ import annotations

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.trace.v1 import trace_pb2 as tp


def turn_messages(
    trace_id: str,
    user_text: str,
    *,
    source: int = tp.MESSAGE_SOURCE_USER,
    a2a_task_id: str = "",
    caller_agent: str = "",
    caller_trace_id: str = "",
    model: str = "",
    ids: tuple[int, int] = (0, 0),
) -> tuple[tp.Message, tp.Message]:
    """The user message (completed) and the assistant placeholder (pending, with the model) of a turn,
    with their provenance; `ids`: the ids they are stored under (0: the trace service picks)."""

    def message(role: int, content: str, status: int, message_id: int) -> tp.Message:
        return tp.Message(
            id=message_id,
            trace_id=trace_id,
            role=role,  # type: ignore[arg-type]
            content=content,
            status=status,  # type: ignore[arg-type]
            source=source or tp.MESSAGE_SOURCE_USER,  # type: ignore[arg-type]
            a2a_task_id=a2a_task_id,
            caller_agent=caller_agent,
            caller_trace_id=caller_trace_id,
            model=model if role == tp.MESSAGE_ROLE_ASSISTANT else "",
        )

    return (
        message(tp.MESSAGE_ROLE_USER, user_text, tp.MESSAGE_STATUS_COMPLETED, ids[0]),
        message(tp.MESSAGE_ROLE_ASSISTANT, "", tp.MESSAGE_STATUS_PENDING, ids[1]),
    )


def turn_start(trace_id: str, user_message_id: int, assistant_message_id: int, agent: str) -> ev.Event:
    """The `start` of a turn: the first event of its buffer."""
    return ev.Event(
        start=ev.TurnStart(
            trace_id=trace_id,
            user_message_id=user_message_id,
            assistant_message_id=assistant_message_id,
            agent=agent,
        )
    )
