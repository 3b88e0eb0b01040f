"""The browser UI: index.html at `/`, its static assets under `/ui/...`; no auth (the page asks for a key)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(include_in_schema=False)
router.mount("/ui", StaticFiles(directory=STATIC / "ui"), name="ui")


@router.get("/")
async def index() -> FileResponse:
    """The single page; revalidated on every load so a new deploy shows at once."""
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})
