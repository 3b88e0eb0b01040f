"""The orchestrator's reaper settles what a dead process left behind, and only that: a newer turn of the
same session, whose live buffer has the same key, streams on. (Found by the chaos run: a session whose
orchestrator died took a new turn once the old buffer's lease ended it, then the restarted orchestrator's
reaper closed the new turn's buffer by key, and the turn failed with `stream ... is closed`.)"""

from __future__ import annotations

import pytest

from agentmesh.libs import identity
from agentmesh.libs.ids import trace_key
from agentmesh.services.orchestrator.reaper import Reaper
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.mesh import BACKENDS, Mesh, wait_until

LEASE_S = 0.3  # rows: reaped within a fraction of a second once nobody renews them


# Rows' leases are short; the live buffer's lease outlasts the test.
pytestmark = pytest.mark.mesh(
    backends=BACKENDS, scope="function", lease_s=LEASE_S, stream_options={"lease_s": 60}
)


async def test_reaping_a_dead_turn_leaves_the_sessions_new_turn_streaming(mesh: Mesh) -> None:
    assert mesh.clients is not None
    t, s = mesh.clients.trace, mesh.clients.stream
    with identity.acting_as(mesh.user):
        trace = (
            await t.CreateTrace(ts.CreateTraceRequest(trace=tp.Trace(agent="general", title="reaped")))
        ).trace
        dead = tp.Message(role=tp.MESSAGE_ROLE_ASSISTANT, status=tp.MESSAGE_STATUS_PENDING)
        asked = tp.Message(role=tp.MESSAGE_ROLE_USER, content="never answered")
        begun = await mesh.clients.messages.BeginTurn(
            ms.BeginTurnRequest(trace_id=trace.id, user_message=asked, assistant_message=dead)
        )
        orphan = begun.assistant_message
        # The new turn's buffer, under the same key, with a live lease.
        await s.CreateStream(ss.CreateStreamRequest(key=trace_key(trace.id)))

    async def reaped() -> bool:
        assert mesh.clients is not None
        with identity.acting_as(mesh.user):
            got = await mesh.clients.messages.GetMessage(ms.GetMessageRequest(message_id=orphan.id))
        return got.message.status != tp.MESSAGE_STATUS_PENDING

    await wait_until(reaped, 10, "the orphaned placeholder to be settled by the reaper")
    # A reaper round that settled the row has run; one more full round to be sure it closed nothing.
    await Reaper(mesh.clients, LEASE_S).reap()
    with identity.acting_as(mesh.user):
        info = await s.GetStreamInfo(ss.GetStreamInfoRequest(key=trace_key(trace.id)))
    assert info.exists and not info.closed, "the newer turn's live buffer was ended by the reaper"
