"""The A2A routes of the gateway: each public agent's card, and its JSON-RPC endpoint, where the SDK's
dispatcher answers A2A v1.0 (SendMessage, SendStreamingMessage, GetTask, ListTasks, CancelTask,
SubscribeToTask) and v0.3 (message/send, message/stream, tasks/get, tasks/cancel, tasks/resubscribe).

The HTTP part follows the gateway's rules: a missing or wrong key is 401, an unknown or private agent
404, both with the JSON error body; what is inside a JSON-RPC body is answered in JSON-RPC. The A2A
protocol describes these routes (the card and the A2A specification), so they stay out of the
gateway's OpenAPI document.
"""

from __future__ import annotations

import json
import logging
import math
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
from agentmesh.libs import identity, jsonbound
from agentmesh.libs.errors import NotFound

log = logging.getLogger(__name__)
router = APIRouter(include_in_schema=False)
# JSON-RPC 2.0's codes (section 5.1) the gateway answers itself.
PARSE_ERROR, INVALID_REQUEST, INVALID_PARAMS, INTERNAL_ERROR = -32700, -32600, -32602, -32603
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
    refused = await bounded_body(request)
    if refused is not None:
        return refused
    return without_internals(await state.a2a.dispatcher.handle_requests(request))


def rpc_error(request_id: Any, code: int, message: str) -> JSONResponse:
    """A JSON-RPC 2.0 error response (HTTP 200, as the SDK answers them)."""
    return JSONResponse({"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}})


def _envelope_id(body: bytes) -> tuple[bool, Any]:
    """(whether `body`, read without the bound, is a JSON-RPC 2.0 request, its id when that keeps the
    bound): a request whose params break the bound is -32602, anything else -32600."""
    try:  # an integer too long for Python becomes NaN here: it keeps no bound
        data = json.loads(body, parse_int=lambda text: int(text) if len(text) < 100 else math.nan)
    except (ValueError, RecursionError):
        return False, None
    if not isinstance(data, dict) or data.get("jsonrpc") != "2.0" or not isinstance(data.get("method"), str):
        return False, None
    request_id = data.get("id")
    try:
        jsonbound.check(request_id)
        jsonbound.check(data["method"])
    except jsonbound.BoundError:
        return False, None
    if isinstance(request_id, bool) or not isinstance(request_id, str | int | None):
        return False, None
    return True, request_id


async def bounded_body(request: Request) -> Response | None:
    """The body parsed under the JSON bound (libs/jsonbound.py) for the dispatcher, or the JSON-RPC error
    that answers it: -32700 for what is not UTF-8 JSON, -32602 for a request whose params break the
    bound (too deep, a number too large or not finite, U+0000 or a lone surrogate), -32600 for the rest."""
    body = await request.body()
    try:
        request._json = jsonbound.loads(body)  # what request.json() returns from here on
    except jsonbound.BoundError as err:
        ok, request_id = _envelope_id(body)
        if ok:
            return rpc_error(request_id, INVALID_PARAMS, f"Invalid params: {err.message}")
        return rpc_error(None, INVALID_REQUEST, f"Invalid Request: {err.message}")
    except UnicodeDecodeError:
        return rpc_error(None, PARSE_ERROR, "Parse error: the body is not UTF-8")
    except ValueError:
        return rpc_error(None, PARSE_ERROR, "Parse error: the body is not JSON")
    return None


def without_internals(response: Response) -> Response:
    """An internal error (-32603) as a JSON-RPC answer says only that: the SDK puts the exception's
    text in its message (Python's own words, an address); that text is in the log already."""
    if not isinstance(response, JSONResponse):
        return response
    try:
        data = json.loads(bytes(response.body))
    except ValueError:
        return response
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and error.get("code") == INTERNAL_ERROR:
        log.info("A2A request %r: internal error %r", data.get("id"), str(error.get("message"))[:500])
        return rpc_error(data.get("id"), INTERNAL_ERROR, "Internal error")
    return response
