"""Agent routes (AgentService): list, read, create, change, delete and clone the caller's agents, and
the options of an agent's settings. An agent travels as its camelCase JSON (libs.protojson); its
version is the ETag of every response that carries one agent, and a write names the version it was
made against with If-Match (412 when the agent changed meanwhile)."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from google.protobuf import field_mask_pb2, json_format
from pydantic import BaseModel, ConfigDict, Field

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.gateway.deps import clients, current_user
from agentmesh.gateway.errors import AUTH, READ, WRITE, responses
from agentmesh.gateway.openapi import AGENT, AGENT_INPUT, AGENT_OPTIONS, agent_links, obj, ok
from agentmesh.gateway.params import IF_MATCH, IF_MATCH_PARAMETER, NEW_SLUG_PATTERN, NO_NUL, Slug
from agentmesh.libs.errors import InvalidArgument, rpc
from agentmesh.libs.protojson import given_paths, to_json

router = APIRouter(prefix="/api/agents", tags=["agents"])

User = Annotated[str, Depends(current_user)]


class CloneBody(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    new_slug: str = Field(default="", alias="newSlug", max_length=100, pattern=NEW_SLUG_PATTERN)
    name: str = Field(default="", max_length=200, pattern=NO_NUL)


def _one(agent: ap.Agent, status: int = 200) -> JSONResponse:
    """{"agent": {...}} with the agent's version as its ETag."""
    return JSONResponse({"agent": to_json(agent)}, status_code=status, headers={"ETag": f'"{agent.version}"'})


def _if_match(request: Request) -> int:
    """The version named by If-Match (`"3"`, `W/"3"` or `3`); 0 when absent or `*` (no check)."""
    match = IF_MATCH.fullmatch(request.headers.get("if-match", "").strip(" \t"))
    if match is None:  # (ASCII digits only: str.isdigit() also takes "²", which int() refuses)
        raise InvalidArgument('If-Match must be the version of the agent, as its ETag gives it ("3")')
    return int(match.group(1) or 0)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _check_text(data: Any) -> None:
    """InvalidArgument for U+0000 in any string or key of `data` (PostgreSQL cannot store it)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                raise InvalidArgument("the agent must not contain U+0000")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


async def _agent_body(request: Request) -> tuple[ap.Agent, list[str]]:
    """The request's JSON agent and the paths of the fields it gives (a merge patch)."""
    try:
        data = json.loads(await request.body(), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, NaN, nested too deep, 5000 digits
        raise InvalidArgument("the body must be a JSON object: an agent") from exc
    if not isinstance(data, dict):
        raise InvalidArgument("the body must be a JSON object: an agent")
    _check_text(data)
    agent = ap.Agent()
    try:
        json_format.ParseDict(data, agent)
        paths = given_paths(data, ap.Agent.DESCRIPTOR)
    except json_format.ParseError as exc:
        raise InvalidArgument(str(exc)[:500]) from exc
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:
        raise InvalidArgument(f"invalid agent: {type(exc).__name__}") from exc
    return agent, paths


# An agent as a write takes it (POST creates, PATCH merges it in).
_AGENT_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": AGENT_INPUT}}}}
_ONE = ok(obj(agent=AGENT), "the agent; ETag: its version", links=agent_links("/agent/slug"))


@router.get(
    "",
    responses={
        **ok(obj(agents={"type": "array", "items": AGENT}), links=agent_links("/agents/0/slug")),
        **responses(*AUTH),
    },
)
async def list_agents(request: Request, user: User) -> dict[str, Any]:
    """The caller's agents and the built-in ones, each with its agent-invoke limits and its effective
    subagent config: {"agents": [...]}."""
    resp = await rpc(clients(request).agents.ListAgents(ag.ListAgentsRequest()))
    return {"agents": [to_json(a) for a in resp.agents]}


# Before /{slug}: "options" is a route, not an agent.
@router.get("/options", responses={**ok(AGENT_OPTIONS), **responses(*AUTH)})
async def agent_options(request: Request, user: User) -> Any:
    """What an agent's settings may name: {tools: [{name, description, roles}], presetAgents, callees,
    blockedToolNames, ranges: [{field, min, max}], defaults}."""
    return to_json(await rpc(clients(request).agents.GetAgentOptions(ag.GetAgentOptionsRequest())))


@router.api_route("/options", methods=["POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
async def agent_options_other_methods() -> None:
    """A concrete path wins over /{slug} for every method, as OpenAPI matches paths: 405, no agent."""
    raise HTTPException(status_code=405)


@router.get("/{slug}", responses={**_ONE, **responses(*READ)})
async def get_agent(request: Request, user: User, slug: Slug) -> JSONResponse:
    """{"agent": {...}}, ETag: its version. 404 for an unknown slug or another user's agent."""
    return _one((await rpc(clients(request).agents.GetAgent(ag.GetAgentRequest(slug=slug)))).agent)


@router.post(
    "",
    status_code=201,
    responses={201: _ONE[200], **responses(*WRITE, 409)},
    openapi_extra=_AGENT_BODY,
)
async def create_agent(request: Request, user: User) -> JSONResponse:
    """A new agent of the caller's from its JSON (fields not given take their defaults): 201
    {"agent": {...}}. 409 when the caller has one of that slug, 422 naming a bad field."""
    agent, paths = await _agent_body(request)
    create = ag.CreateAgentRequest(agent=agent, field_mask=field_mask_pb2.FieldMask(paths=paths))
    return _one((await rpc(clients(request).agents.CreateAgent(create))).agent, status=201)


@router.patch(
    "/{slug}",
    responses={**_ONE, **responses(*WRITE, 403, 412)},
    openapi_extra={**_AGENT_BODY, "parameters": [IF_MATCH_PARAMETER]},
)
async def update_agent(request: Request, user: User, slug: Slug) -> JSONResponse:
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


@router.delete(
    "/{slug}",
    responses={**ok(obj(deleted={"const": True})), **responses(*READ, 403, 412)},
    openapi_extra={"parameters": [IF_MATCH_PARAMETER]},
)
async def delete_agent(request: Request, user: User, slug: Slug) -> dict[str, bool]:
    """Deletes the caller's own agent (If-Match: its version, optional). A turn already running with it
    finishes; messages that name it keep their rows."""
    await rpc(
        clients(request).agents.DeleteAgent(
            ag.DeleteAgentRequest(slug=slug, expected_version=_if_match(request))
        )
    )
    return {"deleted": True}


@router.post("/{slug}/clone", status_code=201, responses={201: _ONE[200], **responses(*WRITE, 409)})
async def clone_agent(
    request: Request, user: User, slug: Slug, body: CloneBody | None = None
) -> JSONResponse:
    """A copy of a built-in or an own agent as a new agent of the caller's ({"newSlug", "name"},
    both optional): 201 {"agent": {...}}."""
    body = body or CloneBody()
    clone = ag.CloneAgentRequest(slug=slug, new_slug=body.new_slug, name=body.name)
    return _one((await rpc(clients(request).agents.CloneAgent(clone))).agent, status=201)
