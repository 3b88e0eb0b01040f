"""Hypothesis on every parser behind the gateway's routes, through a real mesh on both backend pairs:
page tokens as the gateway passes them to the trace service, session and subagent ids in paths, task ids
in the query, Last-Event-ID and lastEventId. Whatever the string, the answer is a 2xx or the 4xx the
document states, with the JSON error body: never a 5xx.

Hypothesis drives a synchronous httpx client in a worker thread while the mesh serves from the test's
event loop."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentmesh.gateway.errors import reasons_for
from tests.mesh import BACKENDS, TEST_CATALOG, Mesh, chat

EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# A user of its own: PostgreSQL is shared by every mesh of the run (each has an "alice").
pytestmark = pytest.mark.mesh(backends=BACKENDS, catalog=TEST_CATALOG, user="parsers")


@pytest.fixture(scope="module", autouse=True)
async def sessions(mesh: Mesh) -> None:
    """A few sessions, so that a page token's position falls among real rows."""
    for i in range(3):
        await chat(mesh, "general", f"hello {i}")


def check_answer(r: httpx.Response, allowed: set[int]) -> None:
    """A status of `allowed`; every error in the JSON body with a reason of the table that maps to it."""
    assert r.status_code in allowed, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["code"] == r.status_code
        assert error["reason"] in reasons_for(r.status_code), error
        assert isinstance(error["message"], str) and "Traceback" not in error["message"]


async def in_thread(mesh: Mesh, test: Callable[[httpx.Client], None]) -> None:
    def run() -> None:
        headers = {"Authorization": f"Bearer {mesh.api_key}"}
        with httpx.Client(base_url=mesh.url, headers=headers, timeout=30) as http:
            test(http)

    await asyncio.to_thread(run)


def token(stamp: str, trace_id: Any) -> str:
    """A page token shaped as the trace service shapes its own (base64url of [stamp, id])."""
    raw = json.dumps([stamp, trace_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


stamps = st.one_of(
    st.datetimes(timezones=st.sampled_from([UTC, timezone(timedelta(hours=23, minutes=59))])).map(
        datetime.isoformat
    ),
    st.datetimes().map(datetime.isoformat),  # naive: read as UTC
    st.text(max_size=40),
)
forged_tokens = st.builds(token, stamps, st.one_of(st.text(max_size=80), st.integers(), st.none()))


async def test_any_page_token_is_200_or_422(mesh: Mesh) -> None:
    @EXAMPLES
    @given(st.one_of(st.text(max_size=600), forged_tokens))
    def check(http: httpx.Client, page_token: str) -> None:
        r = http.get("/api/sessions", params={"page_token": page_token, "page_size": 1})
        check_answer(r, {200, 422})

    await in_thread(mesh, check)


async def test_the_issued_page_tokens_page_through_every_session(mesh: Mesh) -> None:
    """The positive side: tokens the service issued are taken (no 422 for its own)."""

    def check(http: httpx.Client) -> None:
        seen: list[str] = []
        page_token = ""
        for _ in range(10):
            r = http.get("/api/sessions", params={"page_token": page_token, "page_size": 1})
            assert r.status_code == 200, r.text
            seen += [s["id"] for s in r.json()["sessions"]]
            page_token = r.json()["nextPageToken"]
            if not page_token:
                break
        assert len(seen) == len(set(seen)) == 3

    await in_thread(mesh, check)


# Any text but the dot segments an HTTP client resolves away ("/a/./b" is "/a/b").
path_segments = st.text(min_size=1, max_size=100).filter(lambda s: s not in (".", ".."))

# Paths of the routes that take a session id (GET unless said), with the answers a string can get.
SESSION_ROUTES = [
    ("GET", "/api/sessions/{}"),
    ("GET", "/api/sessions/{}/messages"),
    ("GET", "/api/sessions/{}/stream"),
    ("PATCH", "/api/sessions/{}"),
    ("POST", "/api/sessions/{}/cancel"),
    ("DELETE", "/api/sessions/{}"),
]


async def test_any_session_id_in_a_path_is_404_or_422(mesh: Mesh) -> None:
    @EXAMPLES
    @given(st.sampled_from(SESSION_ROUTES), path_segments)
    def check(http: httpx.Client, route: tuple[str, str], ident: str) -> None:
        method, path = route
        body = {"title": "renamed"} if method == "PATCH" else None
        r = http.request(method, path.format(quote(ident, safe="")), json=body)
        # 404: no such session, or no route for the path an id with "/" makes; 405: a route of another
        # method on that path.
        check_answer(r, {404, 405, 422})

    await in_thread(mesh, check)


async def test_any_subagent_or_task_id_is_404_or_422(mesh: Mesh) -> None:
    @EXAMPLES
    @given(path_segments, st.booleans())
    def check(http: httpx.Client, ident: str, task: bool) -> None:
        if task:
            r = http.get("/api/agents/a2a/stream", params={"taskId": ident})
        else:
            r = http.get(f"/api/subagents/{quote(ident, safe='')}/stream")
        assert r.url.path.startswith(("/api/subagents/", "/api/agents/a2a/stream")), r.url
        check_answer(r, {404, 422})

    await in_thread(mesh, check)


async def test_any_last_event_id_on_a_finished_turn(mesh: Mesh) -> None:
    """A closed buffer: a valid offset replays what follows it (200, an event stream that ends), any
    other string is the 422 of resume_offset."""
    session = (await chat(mesh, "general", "offsets"))[0]["traceId"]
    path = f"/api/sessions/{session}/stream"
    digits = st.integers(min_value=0, max_value=2**66).map(str)
    shaped = st.one_of(digits, st.tuples(digits, digits).map("-".join))
    # A header value is visible Latin-1 (httpx's h11 refuses control characters); a query any text.
    visible = st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f")
    header = st.one_of(st.text(visible, max_size=60), shaped)
    query = st.one_of(st.text(max_size=60), shaped)

    @EXAMPLES
    @given(st.one_of(header.map(lambda v: (v, True)), query.map(lambda v: (v, False))))
    def check(http: httpx.Client, case: tuple[str, bool]) -> None:
        offset, as_header = case
        if as_header:
            # (h11 strips the blanks around a header value: the client refuses to send them)
            r = http.get(path, headers={b"Last-Event-ID": offset.strip(" \t").encode("latin-1")})
        else:
            r = http.get(path, params={"lastEventId": offset})
        check_answer(r, {200, 422})
        if r.status_code == 200:
            assert r.headers["content-type"].startswith("text/event-stream")

    await in_thread(mesh, check)


async def test_text_with_u0000_is_a_422_on_both_backends(mesh: Mesh) -> None:
    """PostgreSQL cannot store U+0000 (it was a 500 there, and stored on SQLite): the gateway refuses
    it in what it passes on, alike on both."""
    session = (await chat(mesh, "general", "nul"))[0]["traceId"]
    async with mesh.http() as http:
        cases = [
            ("POST", "/api/chat", {"agent": "general", "message": "a\x00b"}, "body.message"),
            ("POST", "/api/chat", {"agent": "gen\x00eral", "message": "hi"}, "body.agent"),
            (
                "POST",
                "/api/chat",
                {"agent": "general", "message": "hi", "sessionId": "\x00"},
                "body.sessionId",
            ),
            ("PATCH", f"/api/sessions/{session}", {"title": "a\x00"}, "body.title"),
        ]
        for method, path, body, where in cases:
            r = await http.request(method, path, json=body)
            assert r.status_code == 422, (body, r.text)
            assert r.json()["error"]["message"].startswith(f"invalid request: {where}: "), r.text
        title = (await http.get(f"/api/sessions/{session}")).json()["session"]["title"]
    assert title == "nul"


async def test_an_agent_with_u0000_is_a_422_on_both_backends(mesh: Mesh) -> None:
    async with mesh.http() as http:
        for body in ({"slug": "nul", "name": "a\x00b"}, {"slug": "nul", "name": "ok", "tools": ["\x00"]}):
            r = await http.post("/api/agents", json=body)
            assert r.status_code == 422, r.text
            message = r.json()["error"]["message"]  # the JSON bound (libs/jsonbound.py) answers first
            assert message.startswith("invalid request: body.")
            assert message.endswith("must not contain U+0000")
        r = await http.post("/api/agents/general/clone", json={"name": "a\x00"})
        assert r.status_code == 422 and r.json()["error"]["message"].startswith("invalid request: body.name")
