"""The A2A routes of the gateway: each public agent's card, and its JSON-RPC endpoint, where the SDK's
dispatcher answers A2A v1.0 (SendMessage, SendStreamingMessage, GetTask, ListTasks, CancelTask,
SubscribeToTask) and v0.3 (message/send, message/stream, tasks/get, tasks/cancel, tasks/resubscribe).

The HTTP part follows the gateway's rules: a missing or wrong key is 401, an unknown or private agent
404, both with the JSON error body; what is inside a JSON-RPC body is answered in JSON-RPC. The A2A
protocol describes these routes (the card and the A2A specification), so they stay out of the
gateway's OpenAPI document.
"""

from __future__ import annotations

from typing import Any

from a2a.server.request_handlers.response_helpers import agent_card_to_dict
from a2a.server.routes import DefaultServerCallContextBuilder
from a2a.server.routes.jsonrpc_dispatcher import JsonRpcDispatcher
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request as StarletteRequest

from agentmesh.gateway.a2a.calls import AGENT_KEY
from agentmesh.gateway.a2a.cards import agent_card, public_agent
from agentmesh.gateway.deps import authenticate
from agentmesh.gateway.params import Slug
from agentmesh.libs import identity
from agentmesh.libs.errors import NotFound

router = APIRouter(include_in_schema=False)
# The methods of these paths, for the gateway's 405 answers (gateway/errors.py: they are not in the
# OpenAPI document, which it reads for the others).
PATHS = (
    ("/.well-known/agent-card.json", ("GET", "HEAD")),
    ("/a2a/{slug}/.well-known/agent-card.json", ("GET", "HEAD")),
    ("/a2a/{slug}", ("POST",)),
)
CARD_PATH = "/.well-known/agent-card.json"
# Whose view an anonymous card reader gets: a name no user can have (user names are 1-200 characters),
# so only the built-in agents are found.
ANONYMOUS = "anonymous-card-reader:" + "-" * 200


class AgentContextBuilder(DefaultServerCallContextBuilder):
    """The SDK's call context, plus the agent the request's path addresses."""

    def build(self, request: StarletteRequest) -> Any:
        context = super().build(request)
        context.state[AGENT_KEY] = request.path_params.get("slug", "")
        return context


def dispatcher(handler: Any) -> JsonRpcDispatcher:
    return JsonRpcDispatcher(handler, context_builder=AgentContextBuilder(), enable_v0_3_compat=True)


async def _card(request: Request, slug: str) -> Response:
    state = request.app.state
    header = request.headers.get("authorization")
    if header:
        await authenticate(state, header)  # a key: the agents this user sees (their own public ones too)
        agent = await public_agent(state.clients, slug)
    else:
        with identity.acting_as(ANONYMOUS):
            agent = await public_agent(state.clients, slug)
    if agent is None:
        raise NotFound(f"no public agent {slug!r}")
    settings = state.settings
    base = settings.a2a.public_url.rstrip("/") or str(request.base_url).rstrip("/")
    card = agent_card(agent, base, state.a2a.grpc_url, push=bool(settings.a2a.push_allowed_urls))
    return JSONResponse(agent_card_to_dict(card), headers={"Cache-Control": "no-cache"})


@router.get("/.well-known/agent-card.json")
async def default_card(request: Request) -> Response:
    return await _card(request, request.app.state.settings.a2a.default_agent)


@router.get("/a2a/{slug}/.well-known/agent-card.json")
async def card(request: Request, slug: Slug) -> Response:
    return await _card(request, slug)


@router.post("/a2a/{slug}")
async def jsonrpc(request: Request, slug: Slug) -> Response:
    state = request.app.state
    await authenticate(state, request.headers.get("authorization"))
    if await public_agent(state.clients, slug) is None:
        raise NotFound(f"no public agent {slug!r}")
    return await state.a2a.dispatcher.handle_requests(request)  # type: ignore[no-any-return]
