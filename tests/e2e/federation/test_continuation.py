"""The two scenarios of docs/requirements.md#federation-scenarios end to end, both ways, with the live side
panel: an agent calls a peer's
agent (`agentSlug: "@alias/slug"`) and gets back the location-bearing id of the peer's trace with
`remote: true`; continueFrom that id with the same peer's agent continues it there (its /run);
continueFrom it with one of our agents reads the peer's main path as history and appends the turn to
the peer's trace. In org A (one database) a trace of the other mesh is simply local."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from agentmesh.libs import identity
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import task_service_pb2 as tks
from tests.e2e.federation.conftest import RULES, Fed
from tests.mesh import Mesh, chat, sse_events, wait_request


def tool_output(events: list[dict[str, Any]]) -> dict[str, Any]:
    outs = [e for e in events if e["type"] == "tool-output-available"]
    assert outs, events
    out = outs[-1]["output"]
    return out if isinstance(out, dict) else json.loads(out)


async def messages(mesh: Mesh, trace_id: str) -> list[str]:
    async with mesh.http() as http:
        resp = await http.get(f"/api/traces/{trace_id}/messages", params={"limit": 1000})
    assert resp.status_code == 200, resp.text
    return [m["content"] for m in resp.json()["messages"]]


async def test_scenario_1_cloud_calls_a_peers_agent_and_continues_its_trace_both_ways(fed: Fed) -> None:
    first = tool_output(await chat(fed.cloud, "general", "remote-invoke @orgb/coder hello there"))
    assert first["ok"] is True and first["remote"] is True, first
    assert first["output"] == "coder says: hello there"
    ref = first["traceId"]
    assert ref.startswith("@orgb/")
    home_id = ref.split("/", 1)[1]
    assert await messages(fed.orgb, home_id) == ["hello there", "coder says: hello there"]

    # the same peer's agent: continued there, through its /run
    second = tool_output(await chat(fed.cloud, "general", f"remote-continue @orgb/coder {ref} go on"))
    assert second["ok"] is True and second["traceId"] == ref and second["remote"] is True, second
    assert (await messages(fed.orgb, home_id))[-2:] == ["go on", "coder says: go on"]

    # one of our agents: the peer's main path is its history, and the turn is appended at home
    start = len(await fed.cloud.mock.wait_requests(0))
    third = tool_output(await chat(fed.cloud, "general", f"remote-continue coder {ref} now locally"))
    assert third["ok"] is True and third["traceId"] == ref and third["remote"] is True, third
    body = await wait_request(
        fed.cloud.mock, lambda b: "[coder]" in json.dumps(b) and "now locally" in json.dumps(b), start=start
    )
    history = [m.get("content") for m in body["messages"]]
    assert "hello there" in history and "coder says: go on" in history, history
    assert (await messages(fed.orgb, home_id))[-2:] == ["now locally", "coder says: now locally"]
    # and the cached copy follows (read through A, under the peer's sequences)
    assert (await messages(fed.cloud, ref))[-2:] == ["now locally", "coder says: now locally"]


async def test_scenario_2_a_peer_calls_our_cloud_and_continues_with_its_own_agent(fed: Fed) -> None:
    first = tool_output(await chat(fed.orgb, "general", "remote-invoke @orga/coder from the terminal"))
    assert first["ok"] is True and first["remote"] is True, first
    ref = first["traceId"]
    assert ref.startswith("@orga/")
    home_id = ref.split("/", 1)[1]
    port = fed.cloud.url.rsplit(":", 1)[1]  # the full form of the same id works alike
    second = tool_output(
        await chat(fed.orgb, "general", f"remote-continue coder agent://127.0.0.1:{port}/{home_id} and more")
    )
    assert second["ok"] is True and second["traceId"] == ref, second  # handed out in the short form
    assert (await messages(fed.cloud, home_id))[-4:] == [
        "from the terminal",
        "coder says: from the terminal",
        "and more",
        "coder says: and more",
    ]
    # org A's terminal shares cloud's database: the same trace is local there
    assert (await messages(fed.terminal, home_id))[-1] == "coder says: and more"


async def test_hybrid_a_callee_trace_of_the_cloud_is_continued_on_the_terminal(fed: Fed) -> None:
    first = tool_output(await chat(fed.cloud, "general", "remote-invoke coder in org A"))
    local_id = first["traceId"]
    assert first["ok"] is True and "remote" not in first and "/" not in local_id
    second = tool_output(await chat(fed.terminal, "general", f"remote-continue coder {local_id} continue"))
    assert second["ok"] is True and second["traceId"] == local_id, second
    assert (await messages(fed.cloud, local_id))[-2:] == ["continue", "coder says: continue"]


async def test_a_local_turn_on_a_peers_trace_fails_cleanly_when_the_peer_is_down(fed: Fed) -> None:
    first = tool_output(await chat(fed.cloud, "general", "remote-invoke @orgb/coder before the outage"))
    ref = "@orgbp/" + first["traceId"].split("/", 1)[1]  # the same trace, through the relay
    await fed.proxy.down()
    try:
        failed = tool_output(await chat(fed.cloud, "general", f"remote-continue coder {ref} during"))
    finally:
        await fed.proxy.up()
    assert failed["ok"] is False and failed["code"] == "unavailable", failed
    assert "nothing was appended" in failed["error"]
    home = await messages(fed.orgb, first["traceId"].split("/", 1)[1])
    assert "during" not in home
    assert fed.cloud.clients is not None
    with identity.acting_as(fed.cloud.user):  # no turn left running on the copy: no pending row
        page = await fed.cloud.clients.messages.ListMessages(
            ms.ListMessagesRequest(trace_id=ref, mode=ms.PATH_MODE_ALL, limit=1000)
        )
    assert all(m.content != "during" for m in page.messages)


async def test_the_side_panel_follows_a_peers_agent_live(fed: Fed) -> None:
    slow = {
        **RULES,
        "rules": [{"system": r"\[coder\]", "text": "slow " * 30, "tokens_per_second": 20}, *RULES["rules"]],
    }
    fed.orgb.mock.set_rules(slow)
    try:
        first_delta: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        text: list[str] = []
        async with fed.cloud.http() as http:

            async def panel(task_id: str) -> None:
                async with http.stream("GET", f"/api/agents/a2a/stream?taskId={task_id}") as resp:
                    assert resp.status_code == 200
                    async for event in sse_events(resp):
                        if event["type"] == "text-delta":
                            text.append(event["textDelta"])
                            if not first_delta.done():
                                first_delta.set_result(time.monotonic())

            follower = None
            tool_done = 0.0
            async with http.stream(
                "POST", "/api/chat", json={"agent": "general", "message": "remote-invoke @orgb/coder slowly"}
            ) as resp:
                async for event in sse_events(resp):
                    if event["type"] == "a2a-task-started":
                        assert event["calleeAgentSlug"] == "@orgb/coder"
                        follower = asyncio.create_task(panel(event["taskId"]))
                    if event["type"] == "tool-output-available":
                        tool_done = time.monotonic()
            assert follower is not None
            await asyncio.wait_for(follower, 15)
        assert await first_delta < tool_done - 0.3, "the peer's text reached the panel before the call ended"
        assert "".join(text).strip() == ("slow " * 30).strip()
    finally:
        fed.orgb.mock.set_rules(RULES)


async def test_run_route_json_and_sse(fed: Fed) -> None:
    first = tool_output(await chat(fed.orgb, "general", "remote-invoke coder seed"))
    tid = first["traceId"]
    async with fed.orgb.http() as http:
        as_json = await http.post(f"/api/traces/{tid}/run", json={"input": "json please"})
        assert as_json.status_code == 200, as_json.text
        body = as_json.json()
        assert body["ok"] is True and body["output"] == "coder says: json please" and body["traceId"] == tid
        async with http.stream(
            "POST", f"/api/traces/{tid}/run", json={"input": "sse please"},
            headers={"Accept": "text/event-stream", "Accept-Encoding": "gzip"},
        ) as resp:  # fmt: skip
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert "content-encoding" not in resp.headers  # SSE is never compressed
            kinds = [e["type"] async for e in sse_events(resp)]
        assert kinds[0] == "start" and kinds[-1] == "done" and "text-delta" in kinds
        missing = await http.post("/api/traces/nope/run", json={"input": "x"})
        assert missing.status_code == 404
        # a peer's id is continued at its home (relayed there): org A has no trace of that id
        remote = await http.post(f"/api/traces/@orga/{tid}/run", json={"input": "x"})
        assert remote.status_code == 404, remote.text


async def test_a_turn_that_died_on_a_copy_leaves_nothing_behind(fed: Fed) -> None:
    """A local agent's turn on a peer's trace whose process died: the reaper settles its placeholder;
    the next read of the trace drops what never reached home and brings the copy up to date."""
    import sqlalchemy as sa
    import yaml
    from sqlalchemy.ext.asyncio import create_async_engine

    from agentmesh.trace.v1 import trace_pb2 as tp

    first = tool_output(await chat(fed.cloud, "general", "remote-invoke @orgb/coder to be continued"))
    ref = first["traceId"]
    assert fed.cloud.clients is not None
    user = tp.Message(
        role=tp.MESSAGE_ROLE_USER, content="a turn that dies", status=tp.MESSAGE_STATUS_COMPLETED
    )
    pending = tp.Message(role=tp.MESSAGE_ROLE_ASSISTANT, status=tp.MESSAGE_STATUS_PENDING)
    with identity.acting_as(fed.cloud.user):
        begun = await fed.cloud.clients.messages.BeginTurn(
            ms.BeginTurnRequest(trace_id=ref, user_message=user, assistant_message=pending)
        )
    assert begun.assistant_message.trace_id == ref
    assert "a turn that dies" in await messages(fed.cloud, ref)  # the run's history: the copy, with it
    url = yaml.safe_load(fed.peers_a.read_text())["trace_store"]["internal"]["url"]
    engine = create_async_engine(url.replace("postgresql://", "postgresql+asyncpg://"))
    try:
        async with engine.begin() as conn:  # what the reaper does to a placeholder whose lease ran out
            await conn.execute(
                sa.text("UPDATE messages SET status = 'failed' WHERE id = :id"),
                {"id": begun.assistant_message.id},
            )
    finally:
        await engine.dispose()
    after = await messages(fed.cloud, ref)
    assert "a turn that dies" not in after
    assert after == await messages(fed.orgb, ref.split("/", 1)[1])


async def test_a_peer_dying_while_its_agent_streams(fed: Fed) -> None:
    """The relay of a peer's agent is cut mid-stream: the call fails with a clear error, its buffer ends
    with an `error` event (a following panel gets a terminal event) and its task ends failed."""
    slow = {
        **RULES,
        "rules": [{"system": r"\[coder\]", "text": "word " * 200, "tokens_per_second": 200}, *RULES["rules"]],
    }
    fed.orgb.mock.set_rules(slow)
    fed.proxy.bytes_back = 0
    fed.proxy.cut_after = 2500  # a few events in, the peer's answer stops
    try:
        events = await chat(fed.cloud, "general", "remote-invoke @orgbp/coder a long one")
    finally:
        fed.proxy.cut_after = None
        fed.orgb.mock.set_rules(RULES)
    out = tool_output(events)
    assert out["ok"] is False and out["code"] == "unavailable" and out["remote"] is True, out
    assert "orgbp" in out["error"]
    started = next(e for e in events if e["type"] == "a2a-task-started")
    assert fed.cloud.clients is not None
    with identity.acting_as(fed.cloud.user):
        task = (
            await fed.cloud.clients.tasks.GetA2ATask(tks.GetA2ATaskRequest(task_id=started["taskId"]))
        ).task
    from agentmesh.trace.v1 import trace_pb2 as tp

    assert task.state == tp.TASK_STATE_FAILED
    async with fed.cloud.http() as http:
        resp = await http.get(f"/api/agents/a2a/stream?taskId={started['taskId']}")
    kinds = [line for line in resp.text.splitlines() if line.startswith("data:")]
    assert kinds and '"type": "error"' in kinds[-1].replace('"type":"error"', '"type": "error"'), kinds[-1:]


async def test_a_catalogued_a2a_agents_trace_is_continued_here_when_its_host_is_a_peer(fed: Fed) -> None:
    """`b-coder` is org B's coder in our catalog as a remote A2A agent: its call hands out
    agent://host:port/<contextId>; that host is the registered peer `orgb`, so one of our agents can
    continue the trace (read as history, appended at home), and b-coder itself continues it over A2A."""
    first = tool_output(await chat(fed.cloud, "general", "remote-invoke b-coder catalogued"))
    assert first["ok"] is True and first["remote"] is True, first
    ref = first["traceId"]
    port = fed.orgb.url.rsplit(":", 1)[1]
    assert ref.startswith(f"agent://127.0.0.1:{port}/"), ref
    home_id = ref.rsplit("/", 1)[1]
    second = tool_output(await chat(fed.cloud, "general", f"remote-continue coder {ref} by us"))
    assert second["ok"] is True, second
    third = tool_output(await chat(fed.cloud, "general", f"remote-continue b-coder {ref} by them"))
    assert third["ok"] is True, third
    assert (await messages(fed.orgb, home_id))[-6:] == [
        "catalogued",
        "coder says: catalogued",
        "by us",
        "coder says: by us",
        "by them",
        "coder says: by them",
    ]
