"""AgentService writes on both databases: a user's own agents (create, update by mask at a version,
delete, clone), built-ins read-only, another user's agents invisible, validation naming the field, the
options of an agent's settings, and what a deleted agent leaves behind."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import field_mask_pb2, json_format

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.libs import identity, tools
from agentmesh.libs.config import SubagentDefaults
from agentmesh.libs.errors import from_rpc_error
from agentmesh.libs.protojson import given_paths
from agentmesh.services.trace import agents as rules
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.integration.trace.conftest import append, error_of, new_trace, recent

BAD = grpc.StatusCode.INVALID_ARGUMENT


def agent(**fields: Any) -> ap.Agent:
    return json_format.ParseDict(fields, ap.Agent())


def create_call(stub: Any, owner: str, **fields: Any) -> Any:
    """CreateAgent with the given JSON fields (the field mask: the fields given, as the gateway sends)."""
    paths = given_paths(fields, ap.Agent.DESCRIPTOR)
    with identity.acting_as(owner):
        request = ag.CreateAgentRequest(
            agent=agent(**fields), field_mask=field_mask_pb2.FieldMask(paths=paths)
        )
        return stub.CreateAgent(request)


async def create(stub: Any, owner: str, **fields: Any) -> ap.Agent:
    return (await create_call(stub, owner, **fields)).agent


def update(stub: Any, owner: str, slug: str, paths: list[str], version: int = 0, **fields: Any) -> Any:
    request = ag.UpdateAgentRequest(
        agent=agent(slug=slug, **fields),
        update_mask=field_mask_pb2.FieldMask(paths=paths),
        expected_version=version,
    )
    with identity.acting_as(owner):
        return stub.UpdateAgent(request)


async def failure(call: Any) -> tuple[grpc.StatusCode, str, str]:
    exc = await error_of(call)
    return exc.code(), from_rpc_error(exc).reason, exc.details()


async def test_create_update_and_delete_an_own_agent(agent_stub, unique):
    owner = f"u-{unique}"
    mine = await create(
        agent_stub,
        owner,
        slug="helper",
        name="Helper",
        systemPrompt="Be brief.",
        tools=["agent-invoke"],
        invoke={"allowedCallees": ["coder"], "maxRecursionDepth": 0},
        limits={"maxSteps": 3},
    )
    assert (mine.owner, mine.version, mine.system_prompt) == (owner, 1, "Be brief.")
    assert recent(mine.create_time) and mine.update_time == mine.create_time
    # Given values kept (a given 0 too), every other field defaulted.
    assert mine.invoke.max_recursion_depth == 0 and list(mine.invoke.allowed_callees) == ["coder"]
    assert mine.invoke.max_parallel == rules.DEFAULT_INVOKE.max_parallel
    assert mine.limits == ap.Limits(
        max_steps=3,
        max_output_tokens=rules.DEFAULT_LIMITS.max_output_tokens,
        timeout_ms=rules.DEFAULT_LIMITS.timeout_ms,
    )
    assert mine.model == "mock-gpt" and mine.effective_subagent_config.max_concurrent == 3

    with identity.acting_as(owner):
        listed = {a.slug: a for a in (await agent_stub.ListAgents(ag.ListAgentsRequest())).agents}
        assert listed["helper"] == mine and {"coder", "general", "researcher"} <= set(listed)
        assert (await agent_stub.GetAgent(ag.GetAgentRequest(slug="helper"))).agent == mine
        again = ag.CreateAgentRequest(agent=agent(slug="helper", name="Again"))
        assert (await failure(agent_stub.CreateAgent(again)))[:2] == (
            grpc.StatusCode.ALREADY_EXISTS,
            "ALREADY_EXISTS",
        )

    # A change by mask: only the masked field moves, the version grows by one.
    changed = (await update(agent_stub, owner, "helper", ["system_prompt"], 1, systemPrompt="Be kind.")).agent
    assert (changed.version, changed.system_prompt, changed.limits) == (2, "Be kind.", mine.limits)
    assert changed.create_time == mine.create_time
    assert changed.update_time.ToNanoseconds() > mine.update_time.ToNanoseconds()
    # A nested path changes one number; a masked field left unset resets to its default.
    nested = (
        await update(agent_stub, owner, "helper", ["limits.max_steps", "invoke"], 2, limits={"maxSteps": 5})
    ).agent
    assert (nested.version, nested.limits.max_steps, nested.limits.timeout_ms) == (
        3,
        5,
        mine.limits.timeout_ms,
    )
    assert nested.invoke == rules.DEFAULT_INVOKE
    # A write at a stale version is refused and changes nothing.
    stale = await failure(update(agent_stub, owner, "helper", ["system_prompt"], 2, systemPrompt="late"))
    assert stale == (
        grpc.StatusCode.ABORTED,
        "VERSION_MISMATCH",
        "agent 'helper' is at version 3, not 2: read it again and redo the change",
    )
    # A write that changes nothing keeps the version; version 0 skips the check.
    same = (await update(agent_stub, owner, "helper", ["system_prompt"], 0, systemPrompt="Be kind.")).agent
    assert same == nested
    # The slug names the agent (so it cannot change): a mask naming it changes nothing.
    assert (await update(agent_stub, owner, "helper", ["slug"], 3)).agent == nested
    unknown_path = await failure(update(agent_stub, owner, "helper", ["nope"], 3))
    assert unknown_path == (BAD, "INVALID_ARGUMENT", "unknown field 'nope'")
    # Output-only paths are ignored (a client may send back what it read).
    ignored = (
        await update(agent_stub, owner, "helper", ["version", "owner", "name"], 3, name="Helper 2")
    ).agent
    assert (ignored.version, ignored.owner, ignored.name) == (4, owner, "Helper 2")
    # An empty mask replaces every writable field.
    whole = (await update(agent_stub, owner, "helper", [], 4, name="Whole")).agent
    assert (whole.version, whole.name, whole.system_prompt, list(whole.tools)) == (
        5,
        "Whole",
        "You are a helpful assistant.",
        [],
    )

    with identity.acting_as(owner):
        stale_delete = ag.DeleteAgentRequest(slug="helper", expected_version=4)
        assert (await failure(agent_stub.DeleteAgent(stale_delete)))[1] == "VERSION_MISMATCH"
        await agent_stub.DeleteAgent(ag.DeleteAgentRequest(slug="helper", expected_version=5))
        gone = await failure(agent_stub.GetAgent(ag.GetAgentRequest(slug="helper")))
        assert gone == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND", "unknown agent 'helper'")
        listed_after = [a.slug for a in (await agent_stub.ListAgents(ag.ListAgentsRequest())).agents]
        assert "helper" not in listed_after
        # The slug is free again: a new agent starts at version 1.
    assert (await create(agent_stub, owner, slug="helper", name="Helper")).version == 1


async def test_builtins_are_read_only_and_an_own_agent_hides_one(agent_stub, unique):
    owner = f"u-{unique}"
    with identity.acting_as(owner):
        builtin = (await agent_stub.GetAgent(ag.GetAgentRequest(slug="coder"))).agent
        read_only = (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
        refused = await failure(update(agent_stub, owner, "coder", ["name"], name="Mine"))
        assert refused[:2] == read_only and "clone it" in refused[2]
        assert (await failure(agent_stub.DeleteAgent(ag.DeleteAgentRequest(slug="coder"))))[:2] == read_only
    own = await create(agent_stub, owner, slug="coder", name="My coder")
    with identity.acting_as(owner):
        assert (await agent_stub.GetAgent(ag.GetAgentRequest(slug="coder"))).agent == own
        await agent_stub.DeleteAgent(ag.DeleteAgentRequest(slug="coder"))
        assert (await agent_stub.GetAgent(ag.GetAgentRequest(slug="coder"))).agent == builtin
    with identity.acting_as(f"other-{unique}"):  # built-ins are untouched for everybody
        assert (await agent_stub.GetAgent(ag.GetAgentRequest(slug="coder"))).agent == builtin


async def test_another_users_agent_answers_like_a_missing_one(agent_stub, unique):
    owner, other = f"u-{unique}", f"other-{unique}"
    await create(agent_stub, owner, slug="private", name="Private")
    with identity.acting_as(other):
        for slug in ("private", "missing"):
            expected = (grpc.StatusCode.NOT_FOUND, "NOT_FOUND", f"unknown agent {slug!r}")
            assert await failure(agent_stub.GetAgent(ag.GetAgentRequest(slug=slug))) == expected
            assert await failure(update(agent_stub, other, slug, ["name"], name="Mine")) == expected
            assert await failure(agent_stub.DeleteAgent(ag.DeleteAgentRequest(slug=slug))) == expected
            assert await failure(agent_stub.CloneAgent(ag.CloneAgentRequest(slug=slug))) == expected
        listed = [a.slug for a in (await agent_stub.ListAgents(ag.ListAgentsRequest())).agents]
        assert "private" not in listed
        options = (await agent_stub.GetAgentOptions(ag.GetAgentOptionsRequest())).preset_agents
        assert "private" not in [c.slug for c in options]
        # Nor can another user's agent be named: it is unknown to them.
        with_ref = create_call(
            agent_stub, other, slug="mine", name="M", invoke={"allowedCallees": ["private"]}
        )
        assert (await failure(with_ref))[2] == "invoke.allowedCallees: unknown agent 'private'"
        # The same slug is free for them: slugs are unique per owner.
    assert (await create(agent_stub, other, slug="private", name="Theirs")).owner == other
    with identity.acting_as(owner):
        assert (await agent_stub.GetAgent(ag.GetAgentRequest(slug="private"))).agent.name == "Private"


async def test_validation_names_the_field(agent_stub, unique):
    owner = f"u-{unique}"
    await create(agent_stub, owner, slug="base", name="Base")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": ["agent-invoke", "shell"]}, "tools: unknown tool 'shell'"),
        ({"invoke": {"allowedCallees": ["ghost"]}}, "invoke.allowedCallees: unknown agent 'ghost'"),
        (
            {"subagentConfig": {"allowedPresetAgentIds": ["coder", "ghost"]}},
            "subagentConfig.allowedPresetAgentIds: unknown agent 'ghost'",
        ),
        ({"limits": {"maxSteps": 0}}, "limits.maxSteps must be 1-100"),
        ({"limits": {"timeoutMs": 99}}, "limits.timeoutMs must be 100-3600000"),
        ({"invoke": {"maxParallel": 33}}, "invoke.maxParallel must be 1-32"),
        ({"invoke": {"maxRecursionDepth": 11}}, "invoke.maxRecursionDepth must be 0-10"),
        ({"subagentConfig": {"maxConcurrent": 17}}, "subagentConfig.maxConcurrent must be 1-16"),
        (
            {"subagentConfig": {"allowedToolNames": ["agent-invoke", "clarify"]}},
            "subagentConfig.allowedToolNames: 'clarify' is blocked for every subagent by the mesh",
        ),
        (
            {"subagentConfig": {"allowedToolNames": ["delegate_task"]}},
            "subagentConfig.allowedToolNames: 'delegate_task' is blocked for every subagent by the mesh",
        ),
        (
            {"subagentConfig": {"allowedToolNames": ["nope"]}},
            "subagentConfig.allowedToolNames: 'nope' is not a tool",
        ),
        ({"name": ""}, "name must be 1-200 characters"),
    ]
    for fields, message in cases:
        code, reason, details = await failure(
            create_call(agent_stub, owner, slug="new", **{"name": "N", **fields})
        )
        assert (code, reason) == (BAD, "INVALID_ARGUMENT"), fields
        assert message in details, (fields, details)
        paths = given_paths(fields, ap.Agent.DESCRIPTOR)
        code, _, details = await failure(update(agent_stub, owner, "base", paths, **fields))
        assert code == BAD and message in details, (fields, details)
    bad_slug = ag.CreateAgentRequest(agent=agent(slug="Has Spaces", name="N"))
    with identity.acting_as(owner):
        assert "slug must be" in (await failure(agent_stub.CreateAgent(bad_slug)))[2]
        # Nothing of the refused writes was stored.
        base = (await agent_stub.GetAgent(ag.GetAgentRequest(slug="base"))).agent
        slugs = [a.slug for a in (await agent_stub.ListAgents(ag.ListAgentsRequest())).agents]
    assert base.version == 1 and "new" not in slugs
    # What is allowed: "*", the agent itself, an own agent, a built-in; subagents may get agent-invoke.
    ok = await create(
        agent_stub,
        owner,
        slug="ok",
        name="OK",
        tools=["agent-invoke", "delegate_task", "clarify"],
        invoke={"allowedCallees": ["*", "ok", "base", "coder"]},
        subagentConfig={
            "allowedPresetAgentIds": ["base", "researcher"],
            "allowedToolNames": ["agent-invoke"],
        },
    )
    assert list(ok.invoke.allowed_callees) == ["*", "ok", "base", "coder"]


async def test_clone_a_builtin_and_an_own_agent(agent_stub, unique):
    owner = f"u-{unique}"
    with identity.acting_as(owner):
        general = (await agent_stub.GetAgent(ag.GetAgentRequest(slug="general"))).agent
        first = (await agent_stub.CloneAgent(ag.CloneAgentRequest(slug="general"))).agent
        second = (await agent_stub.CloneAgent(ag.CloneAgentRequest(slug="general"))).agent
        named = (
            await agent_stub.CloneAgent(
                ag.CloneAgentRequest(slug="general-copy", new_slug="mine", name="Mine")
            )
        ).agent
        taken = ag.CloneAgentRequest(slug="general", new_slug="mine")
        assert (await failure(agent_stub.CloneAgent(taken)))[0] == grpc.StatusCode.ALREADY_EXISTS
    assert (first.slug, first.name, first.owner, first.version) == (
        "general-copy",
        "General Assistant (copy)",
        owner,
        1,
    )
    assert (second.slug, named.slug, named.name) == ("general-copy-2", "mine", "Mine")
    for copy in (first, second, named):
        for field in ("system_prompt", "tools", "limits", "invoke", "subagent_config", "model"):
            assert getattr(copy, field) == getattr(general, field), field
        assert not copy.public
    # The copy is the user's own: it changes, the built-in does not.
    changed = (await update(agent_stub, owner, "mine", ["system_prompt"], 1, systemPrompt="Mine now.")).agent
    assert changed.version == 2
    with identity.acting_as(owner):
        assert (await agent_stub.GetAgent(ag.GetAgentRequest(slug="general"))).agent == general


async def test_options_come_from_the_tool_catalog(agent_stub, unique):
    owner = f"u-{unique}"
    await create(agent_stub, owner, slug="own-one", name="Own One")
    with identity.acting_as(owner):
        options = await agent_stub.GetAgentOptions(ag.GetAgentOptionsRequest())
    mesh = SubagentDefaults()
    by_name = {t.name: t for t in options.tools}
    # Every tool an agent can choose (the background subagents' tools come with the delegate tools).
    assert list(by_name) == [n for n in tools.BUILTIN.specs if n not in tools.BACKGROUND_TOOLS]
    for name, option in by_name.items():
        assert option.description == tools.BUILTIN.specs[name].description
    roles = {name: list(t.roles) for name, t in by_name.items()}
    assert roles == {
        "agent-invoke": [ap.AGENT_ROLE_SUPERVISOR, ap.AGENT_ROLE_SUBAGENT, ap.AGENT_ROLE_A2A_CALLEE],
        "delegate_task": [ap.AGENT_ROLE_SUPERVISOR],
        "delegate_parallel": [ap.AGENT_ROLE_SUPERVISOR],
        "clarify": [ap.AGENT_ROLE_SUPERVISOR],
    }
    assert list(options.blocked_tool_names) == mesh.blocked_tool_names
    presets = [(c.slug, c.owner) for c in options.preset_agents]
    assert presets == [("coder", ""), ("general", ""), ("own-one", owner), ("researcher", "")]
    assert [c.slug for c in options.callees] == ["*", "coder", "general", "own-one", "researcher"]
    assert [(r.field, r.min, r.max) for r in options.ranges] == [
        (r.field, r.min, r.max) for r in rules.RANGES
    ]
    assert options.defaults.limits == rules.DEFAULT_LIMITS and options.defaults.invoke == rules.DEFAULT_INVOKE
    assert options.defaults.effective_subagent_config.timeout_ms == mesh.timeout_ms


async def test_deleting_an_agent_keeps_the_rows_that_name_it(
    agent_stub, trace_stub, unique, message_stub, task_stub
):
    """Messages and tasks keep their rows; their reference to the agent is cleared (ON DELETE SET NULL),
    and a run that still names it (its turn was running) can go on writing."""
    owner = f"u-{unique}"
    await create(agent_stub, owner, slug="caller", name="Caller")
    session = await new_trace(trace_stub, owner, agent="caller")
    sent = await append(
        message_stub, owner, session.id, "hi", source=tp.MESSAGE_SOURCE_A2A, caller_agent="caller"
    )
    assert sent.caller_agent == "caller"
    with identity.acting_as(owner):
        task = (
            await task_stub.CreateA2ATask(
                tks.CreateA2ATaskRequest(
                    task=tp.A2ATask(callee_agent="coder", caller_agent="caller", caller_trace_id=session.id)
                )
            )
        ).task
        assert task.caller_agent == "caller"
        await agent_stub.DeleteAgent(ag.DeleteAgentRequest(slug="caller"))
        kept = (await message_stub.GetMessage(ms.GetMessageRequest(message_id=sent.id))).message
        assert (kept.content, kept.caller_agent) == ("hi", "")
        assert (await task_stub.GetA2ATask(tks.GetA2ATaskRequest(task_id=task.id))).task.caller_agent == ""
        assert (await trace_stub.GetTrace(ts.GetTraceRequest(trace_id=session.id))).trace.agent == "caller"
    # The running turn's next writes still name its (now deleted) agent: they are stored, unlinked.
    late = await append(
        message_stub, owner, session.id, "late", source=tp.MESSAGE_SOURCE_A2A, caller_agent="caller"
    )
    assert late.caller_agent == ""
