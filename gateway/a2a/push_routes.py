"""The gateway's push notification keys as a JWKS (docs/a2a.md, "Push notifications"): what a receiver
verifies a notification's JWT with. Public: no key needed."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from agentmesh.gateway.a2a.push_signing import JWKS_PATH

router = APIRouter(include_in_schema=False)
PATHS = ((JWKS_PATH, ("GET", "HEAD")),)  # for the gateway's 405 answers (gateway/errors.py)


@router.get(JWKS_PATH)
async def jwks(request: Request) -> Response:
    signer = request.app.state.a2a.handler.push.signer
    return JSONResponse(signer.jwks(), headers={"Cache-Control": "public, max-age=300"})
