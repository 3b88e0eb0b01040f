"""Agent routes (AgentService): list, read, create, change, delete and clone the caller's agents, and
the options of an agent's settings. An agent travels as its camelCase JSON (libs.protojson); its
version is the ETag of every response that carries one agent, and a write names the version it was
made against with If-Match (412 when the agent changed meanwhile)."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from google.protobuf import field_mask_pb2, json_format
from pydantic import BaseModel, ConfigDict, Field

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from gateway.deps import clients, current_user
from libs.errors import InvalidArgument, rpc
from libs.protojson import given_paths, to_json

router = APIRouter(prefix="/api/agents", tags=["agents"])

User = Annotated[str, Depends(current_user)]


class CloneBody(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    new_slug: str = Field(default="", alias="newSlug", max_length=100)
    name: str = Field(default="", max_length=200)


def _one(agent: ap.Agent, status: int = 200) -> JSONResponse:
    """{"agent": {...}} with the agent's version as its ETag."""
    return JSONResponse({"agent": to_json(agent)}, status_code=status, headers={"ETag": f'"{agent.version}"'})


def _if_match(request: Request) -> int:
    """The version named by If-Match (`"3"`, `W/"3"` or `3`); 0 when absent or `*` (no check)."""
    header = request.headers.get("if-match", "").strip()
    if not header or header == "*":
        return 0
    value = header.removeprefix("W/").strip('"')
    if not value.isdigit() or int(value) < 1:
        raise InvalidArgument('If-Match must be the version of the agent, as its ETag gives it ("3")')
    return int(value)


async def _agent_body(request: Request) -> tuple[ap.Agent, list[str]]:
    """The request's JSON agent and the paths of the fields it gives (a merge patch)."""
    try:
        data = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument("the body must be a JSON object: an agent") from exc
    if not isinstance(data, dict):
        raise InvalidArgument("the body must be a JSON object: an agent")
    agent = ap.Agent()
    try:
        json_format.ParseDict(data, agent)
    except json_format.ParseError as exc:
        raise InvalidArgument(str(exc)) from exc
    return agent, given_paths(data, ap.Agent.DESCRIPTOR)


@router.get("")
async def list_agents(request: Request, user: User) -> dict[str, Any]:
    """The caller's agents and the built-in ones, each with its agent-invoke limits and its effective
    subagent config: {"agents": [...]}."""
    resp = await rpc(clients(request).agents.ListAgents(ag.ListAgentsRequest()))
    return {"agents": [to_json(a) for a in resp.agents]}


# Before /{slug}: "options" is a route, not an agent.
@router.get("/options")
async def agent_options(request: Request, user: User) -> Any:
    """What an agent's settings may name: {tools: [{name, description, roles}], presetAgents, callees,
    blockedToolNames, ranges: [{field, min, max}], defaults}."""
    return to_json(await rpc(clients(request).agents.GetAgentOptions(ag.GetAgentOptionsRequest())))


@router.get("/{slug}")
async def get_agent(request: Request, user: User, slug: str) -> JSONResponse:
    """{"agent": {...}}, ETag: its version. 404 for an unknown slug or another user's agent."""
    return _one((await rpc(clients(request).agents.GetAgent(ag.GetAgentRequest(slug=slug)))).agent)


@router.post("")
async def create_agent(request: Request, user: User) -> JSONResponse:
    """A new agent of the caller's from its JSON (fields not given take their defaults): 201
    {"agent": {...}}. 409 when the caller has one of that slug, 422 naming a bad field."""
    agent, paths = await _agent_body(request)
    create = ag.CreateAgentRequest(agent=agent, field_mask=field_mask_pb2.FieldMask(paths=paths))
    return _one((await rpc(clients(request).agents.CreateAgent(create))).agent, status=201)


@router.patch("/{slug}")
async def update_agent(request: Request, user: User, slug: str) -> JSONResponse:
    """Changes the fields the JSON body gives (a merge patch: `null` resets a field, nested objects
    change only the keys they give). If-Match: the version it was made against (412 when stale)."""
    agent, paths = await _agent_body(request)
    if "slug" in paths and agent.slug != slug:
        raise InvalidArgument("slug cannot change: clone the agent to a new slug instead")
    agent.slug = slug
    # An empty mask would mean "every field"; a body that gives nothing changes nothing (mask: slug).
    update = ag.UpdateAgentRequest(
        agent=agent,
        update_mask=field_mask_pb2.FieldMask(paths=paths or ["slug"]),
        expected_version=_if_match(request),
    )
    return _one((await rpc(clients(request).agents.UpdateAgent(update))).agent)


@router.delete("/{slug}")
async def delete_agent(request: Request, user: User, slug: str) -> dict[str, bool]:
    """Deletes the caller's own agent (If-Match: its version, optional). A turn already running with it
    finishes; messages that name it keep their rows."""
    await rpc(
        clients(request).agents.DeleteAgent(
            ag.DeleteAgentRequest(slug=slug, expected_version=_if_match(request))
        )
    )
    return {"deleted": True}


@router.post("/{slug}/clone")
async def clone_agent(request: Request, user: User, slug: str, body: CloneBody | None = None) -> JSONResponse:
    """A copy of a built-in or an own agent as a new agent of the caller's ({"newSlug", "name"},
    both optional): 201 {"agent": {...}}."""
    body = body or CloneBody()
    clone = ag.CloneAgentRequest(slug=slug, new_slug=body.new_slug, name=body.name)
    return _one((await rpc(clients(request).agents.CloneAgent(clone))).agent, status=201)
