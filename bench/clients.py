"""The streaming clients of the benchmark, one per target, each recording the same `Stream`.

Every client reads the raw bytes of the response and splits SSE lines itself (no per-event
objects), so that one process can read hundreds of concurrent streams. Timestamps are epoch
seconds (`time.time()`), the clock of the model server's request log, so that a delta's arrival
can be put against the time the model server scheduled it.

Tokens are counted as whitespace-separated words: the scripted model's replies are filler words,
one word (and its trailing space) per streamed piece, so a delta that carries k words carries k
tokens whoever coalesced them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

_DECODER = json.JSONDecoder()


@dataclass
class Stream:
    """One streamed reply as a client saw it."""

    target: str
    tag: str  # the user message, unique per stream (matches the model server's request log)
    start: float = 0.0  # epoch seconds, just before the request was sent
    first: float = 0.0  # arrival of the first text delta (0: none)
    end: float = 0.0  # end of the stream (0: did not end)
    times: list[float] = field(default_factory=list)  # arrival of each text-carrying event
    tokens: list[int] = field(default_factory=list)  # tokens carried by that event
    chars: int = 0
    error: str | None = None  # an error code (see `error_code`), None when the reply is whole

    @property
    def token_count(self) -> int:
        return sum(self.tokens)

    def add(self, text: str, now: float) -> None:
        if not text:
            return
        if not self.first:
            self.first = now
        self.times.append(now)
        self.tokens.append(len(text.split()))
        self.chars += len(text)


def error_code(exc: BaseException) -> str:
    """A transport failure as a short code: the httpx/openai exception class name."""
    return type(exc).__name__


def limits(connections: int) -> httpx.Limits:
    """A pool that never makes a stream wait for a connection."""
    return httpx.Limits(max_connections=connections, max_keepalive_connections=connections)


def timeout(read_s: float) -> httpx.Timeout:
    return httpx.Timeout(connect=30.0, read=read_s, write=30.0, pool=read_s)


async def sse(resp: httpx.Response) -> AsyncIterator[tuple[str, str, float]]:
    """(event name, data, arrival time) for each `data:` line of an SSE response."""
    buf = b""
    event = "message"
    async for chunk in resp.aiter_raw():
        now = time.time()
        buf += chunk
        if b"\n" not in chunk:
            continue
        lines = buf.split(b"\n")
        buf = lines.pop()
        for raw in lines:
            line = raw.rstrip(b"\r")
            if line.startswith(b"data:"):
                yield event, line[5:].strip().decode(), now
            elif line.startswith(b"event:"):
                event = line[6:].strip().decode()
            elif not line:
                event = "message"


async def _http_error(resp: httpx.Response) -> str:
    body = await resp.aread()
    code = ""
    try:
        err = json.loads(body).get("error")
        code = str(err.get("code") or err.get("reason") or "") if isinstance(err, dict) else ""
    except (ValueError, AttributeError):
        pass
    return f"http_{resp.status_code}" + (f":{code}" if code else "")


async def mesh(http: httpx.AsyncClient, out: Stream, agent: str) -> Stream:
    """One turn through the gateway: POST /api/chat (Bearer key on the client), SSE until `done`."""
    out.start = time.time()
    try:
        async with http.stream("POST", "/api/chat", json={"agent": agent, "message": out.tag}) as resp:
            if resp.status_code != 200:
                out.error = await _http_error(resp)
                return out
            async for _, data, now in sse(resp):
                event = json.loads(data)
                kind = event.get("type")
                if kind == "text-delta":
                    out.add(event.get("textDelta", ""), now)
                elif kind == "done":
                    out.end = now
                    return out
                elif kind == "error":
                    out.error = f"sse:{event.get('code') or 'error'}"
                    out.end = now
                    return out
            out.error = "eof_before_done"
    except (httpx.HTTPError, OSError) as exc:
        out.error = error_code(exc)
        out.end = time.time()  # when it failed: the error table says after how long
    return out


def langgraph_body(tag: str) -> dict[str, Any]:
    return {
        "assistant_id": "bench",
        "input": {"messages": [{"role": "user", "content": tag}]},
        "stream_mode": "messages-tuple",
        "if_not_exists": "create",
    }


def _content(data: str) -> str:
    """The `content` string of a messages-tuple event without decoding the whole (large) event."""
    i = data.find('"content":')
    if i < 0:
        return ""
    j = i + 10
    while data[j] == " ":
        j += 1
    if data[j] != '"':
        return ""
    value, _ = _DECODER.raw_decode(data, j)
    return value if isinstance(value, str) else ""


async def langgraph(http: httpx.AsyncClient, out: Stream) -> Stream:
    """One run on a new thread of the LangGraph server: POST /threads/{new id}/runs/stream with
    if_not_exists=create (one request per turn, as /api/chat) and stream_mode=messages-tuple; SSE
    until the server closes the stream."""
    out.start = time.time()
    path = f"/threads/{uuid.uuid4()}/runs/stream"
    try:
        async with http.stream("POST", path, json=langgraph_body(out.tag)) as resp:
            if resp.status_code != 200:
                out.error = await _http_error(resp)
                return out
            async for event, data, now in sse(resp):
                if event == "messages":
                    out.add(_content(data), now)
                elif event == "error":
                    try:
                        detail = json.loads(data)
                        name = detail.get("error") if isinstance(detail, dict) else None
                    except ValueError:
                        name = None
                    out.error = f"sse:{name or 'error'}"
                    out.end = now
                    return out
            out.end = time.time()
    except (httpx.HTTPError, OSError) as exc:
        out.error = error_code(exc)
        out.end = time.time()  # when it failed: the error table says after how long
    return out


def chat_body(tag: str) -> dict[str, Any]:
    return {
        "model": "mock-gpt",
        "messages": [{"role": "user", "content": tag}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 4096,
    }


async def direct_raw(http: httpx.AsyncClient, out: Stream) -> Stream:
    """One completion straight from the model server with plain httpx (the many-session baseline:
    the openai client's per-chunk objects would make the load generator the bottleneck)."""
    out.start = time.time()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=chat_body(out.tag)) as resp:
            if resp.status_code != 200:
                out.error = await _http_error(resp)
                return out
            async for _, data, now in sse(resp):
                if data == "[DONE]":
                    out.end = now
                    return out
                if '"content"' in data:
                    choices = json.loads(data).get("choices") or []
                    if choices:
                        out.add(choices[0].get("delta", {}).get("content") or "", now)
            out.error = "eof_before_done"
    except (httpx.HTTPError, OSError) as exc:
        out.error = error_code(exc)
        out.end = time.time()  # when it failed: the error table says after how long
    return out


async def direct_openai(client: Any, out: Stream) -> Stream:
    """One completion straight from the model server with the `openai` client (what the
    agent-runtime itself uses): the single-session baseline of scenarios A and B."""
    out.start = time.time()
    try:
        stream = await client.chat.completions.create(**chat_body(out.tag))
        async for chunk in stream:
            now = time.time()
            for choice in chunk.choices:
                if choice.delta.content:
                    out.add(choice.delta.content, now)
        out.end = time.time()
    except Exception as exc:  # the openai client's errors have no common base worth naming
        out.error = error_code(exc)
    return out
