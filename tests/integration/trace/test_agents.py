"""AgentService: the catalog's built-in agents as the trace process imports and serves them, with the
subagent config in force (agent > global default > system fallback,
docs/requirements.md#subagent-config-priority)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2
from sqlalchemy import text

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.agents.v1 import agent_service_pb2_grpc
from agentmesh.libs import identity
from agentmesh.libs.config import SubagentDefaults
from agentmesh.libs.identity import Signer
from agentmesh.libs.rpc import ServiceServer, channel
from agentmesh.services.trace import agents
from agentmesh.services.trace.server import build
from agentmesh.services.trace.store.sql import SqlStores
from agentmesh.services.trace.store.sql.db import create_engine, migrate
from tests.conftest import service_settings as mesh_settings
from tests.integration.trace.conftest import error_of, recent

DEMO_CATALOG = Path(agents.__file__).parent / "demo_catalog.yaml"


def _names(*names: str) -> struct_pb2.ListValue:
    out = struct_pb2.ListValue()
    out.extend(names)
    return out


def _own_settings(agent: ap.Agent) -> ap.Agent:
    """The agent without its output-only fields: what the catalog says."""
    out = ap.Agent()
    out.CopyFrom(agent)
    for name in agents.OUTPUT_ONLY:
        out.ClearField(name)
    return out


async def test_list_agents_returns_the_catalog_builtins(agent_stub, unique):
    catalog = {a.slug: a for a in agents.load_catalog(DEMO_CATALOG)}
    with identity.acting_as(f"u-{unique}"):
        listed = (await agent_stub.ListAgents(ag.ListAgentsRequest())).agents
    assert [a.slug for a in listed] == ["coder", "general", "researcher"] == sorted(catalog)
    for agent in listed:
        assert _own_settings(agent) == catalog[agent.slug], agent.slug
        assert (agent.owner, agent.version, agent.public) == ("", 1, True)  # the demo agents are A2A servers
        assert recent(agent.create_time, within_s=3600) and agent.update_time == agent.create_time
    by_slug = {a.slug: a for a in listed}
    # Defaults filled in where the catalog says nothing.
    assert by_slug["coder"].limits == agents.DEFAULT_LIMITS
    assert by_slug["coder"].invoke == agents.DEFAULT_INVOKE
    assert list(by_slug["general"].invoke.allowed_callees) == ["coder", "researcher"]

    # The service runs with the default global subagent settings.
    mesh = SubagentDefaults()
    assert by_slug["general"].effective_subagent_config == ap.EffectiveSubagentConfig(
        enabled=True,  # the agent's own
        max_concurrent=3,  # the agent's own
        allowed_preset_agent_ids=_names("coder", "researcher"),  # the agent's own
        blocked_tool_names=mesh.blocked_tool_names,
        timeout_ms=mesh.timeout_ms,  # the global default
    )
    for slug in ("coder", "researcher"):  # nothing of their own: the global defaults
        effective = by_slug[slug].effective_subagent_config
        assert effective == ap.EffectiveSubagentConfig(
            enabled=mesh.enabled,
            max_concurrent=mesh.max_concurrent,
            blocked_tool_names=mesh.blocked_tool_names,
            timeout_ms=mesh.timeout_ms,
        ), slug
        # Absent lists stay absent: any preset agent, the subagent's own tools.
        assert not effective.HasField("allowed_preset_agent_ids") and not effective.HasField(
            "allowed_tool_names"
        )


async def test_get_agent(agent_stub, unique):
    with identity.acting_as(f"u-{unique}"):
        listed = {a.slug: a for a in (await agent_stub.ListAgents(ag.ListAgentsRequest())).agents}
        for slug, agent in listed.items():
            assert (await agent_stub.GetAgent(ag.GetAgentRequest(slug=slug))).agent == agent
        unknown = await error_of(agent_stub.GetAgent(ag.GetAgentRequest(slug="nobody")))
        assert (unknown.code(), unknown.details()) == (grpc.StatusCode.NOT_FOUND, "unknown agent 'nobody'")
        empty = await error_of(agent_stub.GetAgent(ag.GetAgentRequest()))
        assert empty.code() == grpc.StatusCode.NOT_FOUND
    # Built-in agents are everybody's.
    with identity.acting_as(f"other-{unique}"):
        assert (await agent_stub.GetAgent(ag.GetAgentRequest(slug="general"))).agent == listed["general"]


CATALOG = """
agents:
  - slug: override
    name: Override
    subagentConfig: {maxConcurrent: 2, timeoutMs: 9000}
  - slug: solo
    name: Solo
    subagentConfig: {enabled: false}
  - slug: defaults
    name: Defaults
    description: first
  - slug: lists
    name: Lists
    invoke: {maxRecursionDepth: 0}
    subagentConfig: {allowedPresetAgentIds: [defaults], allowedToolNames: []}
"""
GLOBAL = SubagentDefaults(enabled=True, max_concurrent=5, timeout_ms=30_000, blocked_tool_names=["clarify"])


@pytest.fixture
async def own_catalog(
    empty_database: str, tmp_path: Path
) -> AsyncIterator[tuple[Path, Callable[[], Awaitable[ServiceServer]]]]:
    """(the catalog file, a function starting a trace process on it) over an empty database."""
    path = tmp_path / "catalog.yaml"
    path.write_text(CATALOG)
    settings = mesh_settings(data_dir=tmp_path, database_url=empty_database, catalog=path, subagent=GLOBAL)
    servers: list[ServiceServer] = []

    async def start() -> ServiceServer:
        servers.append(await build(settings, "127.0.0.1:0"))
        return servers[-1]

    yield path, start
    for server in servers:
        await server.stop(0)


async def _agents(server: ServiceServer, signer: Signer, user: str) -> dict[str, ap.Agent]:
    async with channel(server.target, signer) as ch:
        with identity.acting_as(user):
            resp = await agent_service_pb2_grpc.AgentServiceStub(ch).ListAgents(ag.ListAgentsRequest())
    return {a.slug: a for a in resp.agents}


async def test_effective_config_priority_and_reimport(own_catalog, signer, unique):
    path, start = own_catalog
    server = await start()
    listed = await _agents(server, signer, f"u-{unique}")
    assert sorted(listed) == ["defaults", "lists", "override", "solo"]
    effective = {slug: a.effective_subagent_config for slug, a in listed.items()}
    # The agent's own value wins over the global default, field by field.
    assert effective["override"] == ap.EffectiveSubagentConfig(
        enabled=True, max_concurrent=2, timeout_ms=9000, blocked_tool_names=["clarify"]
    )
    assert effective["solo"] == ap.EffectiveSubagentConfig(
        enabled=False, max_concurrent=5, timeout_ms=30_000, blocked_tool_names=["clarify"]
    )
    assert effective["defaults"] == ap.EffectiveSubagentConfig(
        enabled=True, max_concurrent=5, timeout_ms=30_000, blocked_tool_names=["clarify"]
    )
    # An empty list is "none", not "not configured": it stays present.
    assert effective["lists"] == ap.EffectiveSubagentConfig(
        enabled=True,
        max_concurrent=5,
        timeout_ms=30_000,
        allowed_preset_agent_ids=_names("defaults"),
        allowed_tool_names=_names(),
        blocked_tool_names=["clarify"],
    )
    assert effective["lists"].HasField("allowed_tool_names")
    # A zero the catalog gives is kept through the database: maxRecursionDepth 0 forbids agent-invoke.
    assert listed["lists"].invoke.max_recursion_depth == 0
    assert listed["defaults"].invoke.max_recursion_depth == agents.DEFAULT_INVOKE.max_recursion_depth

    # A restart imports the catalog again: a changed agent gets a new version, the others stay as they are.
    await server.stop(0)
    path.write_text(CATALOG.replace("description: first", "description: second"))
    again = await _agents(await start(), signer, f"u-{unique}")
    assert (again["defaults"].version, again["defaults"].description) == (2, "second")
    assert again["defaults"].create_time == listed["defaults"].create_time
    assert again["defaults"].update_time.ToNanoseconds() > listed["defaults"].update_time.ToNanoseconds()
    for slug in ("lists", "override", "solo"):
        assert again[slug] == listed[slug], slug


async def test_replicas_starting_together_import_the_catalog_once(empty_database):
    """Trace processes starting together on one database all import the catalog (none fails on the
    others' inserts), and each built-in agent exists once, at version 1."""
    catalog = agents.load_catalog(DEMO_CATALOG)
    engines = [create_engine(empty_database) for _ in range(4)]
    try:
        await migrate(engines[0])
        for _ in range(8):  # the race is a matter of timing: run it a few times
            async with engines[0].begin() as conn:
                await conn.execute(text("DELETE FROM agents"))
            stores = [SqlStores.open(engine) for engine in engines]
            await asyncio.gather(*(s.agents.import_builtins(catalog) for s in stores))
            async with engines[0].connect() as conn:
                rows = (await conn.execute(text("SELECT slug, version FROM agents ORDER BY slug"))).all()
            assert [tuple(r) for r in rows] == [("coder", 1), ("general", 1), ("researcher", 1)]
    finally:
        for engine in engines:
            await engine.dispose()
