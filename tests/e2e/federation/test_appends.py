"""No acknowledged append is ever lost (docs/federation.md#reading-and-appending-a-peers-trace): an append to
a peer's trace goes to its home by every id form a client can name it by; our cached copy's local id takes
none (409 naming the home id), since what it held would never reach home and the next sync would drop it."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from agentmesh.libs import identity
from agentmesh.libs.clients import MessageAppender
from agentmesh.libs.errors import FailedPrecondition
from agentmesh.trace.v1 import trace_pb2 as tp
from tests.e2e.federation.conftest import Fed
from tests.e2e.federation.test_reads import _pg, new_trace


async def copy_id_of(fed: Fed, home: str, user: str = "alice") -> str:
    """The local id of `user`'s cached copy of `home` at org A (the shared database)."""
    engine = create_async_engine(_pg(fed).replace("postgresql://", "postgresql+asyncpg://"))
    try:
        async with engine.connect() as conn:
            return str(
                (
                    await conn.execute(
                        sa.text(
                            "SELECT t.id FROM traces t JOIN users u ON u.id = t.user_id "
                            "WHERE t.home = :h AND u.name = :u"
                        ),
                        {"h": home, "u": user},
                    )
                ).scalar_one()
            )
    finally:
        await engine.dispose()


def note(text: str) -> dict[str, list[dict[str, str]]]:
    return {"messages": [{"role": "user", "content": text}]}


async def test_every_id_form_appends_at_home_and_the_copy_id_is_refused(fed: Fed) -> None:
    tid = await new_trace(fed.orgb, 1)
    port = fed.orgb.url.rsplit(":", 1)[1]
    forms = {
        "short": f"@orgb/{tid}",
        "address": f"agent://127.0.0.1:{port}/{tid}",
        "encoded address": f"agent%3A%2F%2F127.0.0.1%3A{port}%2F{tid}",
        "relay alias": f"@orgbp/{tid}",  # the same home through another registered peer
    }
    acked: dict[str, dict[str, object]] = {}
    async with fed.cloud.http() as http:
        assert (await http.get(f"/api/traces/@orgb/{tid}")).status_code == 200  # a copy exists now
        copy_id = await copy_id_of(fed, f"@orgb/{tid}")
        for name, ref in forms.items():
            resp = await http.post(f"/api/traces/{ref}/messages", json=note(f"via {name}"))
            assert resp.status_code == 200, (name, resp.text)
            acked[name] = resp.json()["messages"][0]
        refused = await http.post(f"/api/traces/{copy_id}/messages", json=note("via the copy's id"))
        # the copy, read again: every acknowledged message, under the ids the append answered
        page = await http.get(f"/api/traces/@orgb/{tid}/messages", params={"mode": "all"})
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["reason"] == "FAILED_PRECONDITION"
    assert f"@orgb/{tid}" in error["message"] and copy_id in error["message"]
    async with fed.orgb.http() as http:
        home = (await http.get(f"/api/traces/{tid}/messages", params={"mode": "all"})).json()["messages"]
    at_home = {m["content"]: m for m in home}
    for name, message in acked.items():
        assert f"via {name}" in at_home, name
        assert message["sequence"] == at_home[f"via {name}"]["sequence"], name
    assert "via the copy's id" not in at_home
    copied = [m["content"] for m in page.json()["messages"]]
    assert copied[-4:] == [f"via {name}" for name in forms]
    assert "via the copy's id" not in copied


async def test_the_append_stream_refuses_a_copy_by_its_local_id_alone(fed: Fed) -> None:
    """Inside the mesh too (AppendMessageStream): the append to the copy fails alone, the one beside it
    to a trace of ours is written."""
    tid = await new_trace(fed.orgb, 1)
    mine = await new_trace(fed.cloud, 0)
    async with fed.cloud.http() as http:
        assert (await http.get(f"/api/traces/@orgb/{tid}")).status_code == 200
    copy_id = await copy_id_of(fed, f"@orgb/{tid}")
    assert fed.cloud.clients is not None
    appender = MessageAppender(fed.cloud.clients.messages)
    try:
        with identity.acting_as(fed.cloud.user):
            message = tp.Message(trace_id=copy_id, role=tp.MESSAGE_ROLE_USER, content="into the copy")
            try:
                await appender.append(message)
                raise AssertionError("an append to the copy's local id was acknowledged")
            except FailedPrecondition as err:
                assert f"@orgb/{tid}" in err.message
            ours = await appender.append(tp.Message(trace_id=mine, role=tp.MESSAGE_ROLE_USER, content="ok"))
    finally:
        await appender.aclose()
    assert ours.id and ours.trace_id == mine
