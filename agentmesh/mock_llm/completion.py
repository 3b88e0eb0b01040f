"""One chat completion of the scripted model server: its reply as an SSE stream or one JSON body, paced,
or the fault its rule scripts (an HTTP error, a stall, a dropped connection)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from typing import Any, Protocol

from starlette.types import Receive, Scope, Send

from agentmesh.mock_llm.rules import Reply, Rule, content_text, pieces, word_count
from agentmesh.mock_llm.validation import error_response

CUT_AFTER = 3  # content/argument deltas a `cut` stream sends before the connection drops


class Owner(Protocol):
    """What a completion asks of the server that serves it (server.MockLLM)."""

    _closing: asyncio.Event

    def timing(self, rule: Rule) -> tuple[float, float]: ...

    def _enter(self) -> None: ...

    def _leave(self) -> None: ...


class Cut(Exception):
    """Raised inside a started response to make uvicorn drop the connection."""


class QuietCut(logging.Filter):
    """Keeps the deliberate connection drops of `cut` out of uvicorn's error log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], Cut))


def prompt_tokens(body: dict[str, Any]) -> int:
    """A deterministic prompt size: the words of every message content and tool call."""
    total = 0
    for message in body["messages"]:
        total += word_count(content_text(message.get("content")))
        for call in message.get("tool_calls") or []:
            total += 1 + word_count(call["function"]["arguments"])
    return total


def _limit(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return int(value) if value else None


class Pacer:
    """Spaces deltas at `tokens_per_second` (0: as fast as possible) from a fixed start."""

    def __init__(self, tokens_per_second: float) -> None:
        self.interval = 1.0 / tokens_per_second if tokens_per_second > 0 else 0.0
        self.start = asyncio.get_running_loop().time()
        self.count = 0

    async def tick(self) -> None:
        if not self.interval:
            return
        self.count += 1
        delay = self.start + self.count * self.interval - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)


class Completion:
    """The ASGI response of one chat completion: a fault, an SSE stream or one JSON body."""

    def __init__(self, owner: Owner, body: dict[str, Any], rule: Rule, reply: Reply) -> None:
        self.owner, self.body, self.rule, self.reply = owner, body, rule, reply
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.ttft_s, self.tps = owner.timing(rule)
        self.call_ids = [
            "call_" + secrets.token_urlsafe(18).replace("-", "x").replace("_", "y") for _ in reply.tool_calls
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def client_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        self.owner._enter()
        respond = asyncio.create_task(self._respond(scope, send))
        watcher = asyncio.create_task(client_gone())
        try:
            await asyncio.wait({respond, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not respond.done():
                respond.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await respond
                return
            respond.result()
        finally:
            respond.cancel()
            watcher.cancel()
            self.owner._leave()

    async def _respond(self, scope: Scope, send: Send) -> None:
        rule = self.rule
        if rule.barrier is not None:
            await rule.barrier.wait(rule.barrier_timeout_ms / 1000)
        if rule.fault == "http_429":
            message = "Rate limit reached for requests (scripted fault)."
            await error_response(429, message, "requests", "rate_limit_exceeded")(scope, _no_receive, send)
            return
        if rule.fault == "http_500":
            message = "The server had an error while processing your request (scripted fault)."
            await error_response(500, message, "server_error", "internal_error")(scope, _no_receive, send)
            return
        if rule.fault == "stall_before" or (rule.fault == "stall" and not self.body.get("stream")):
            await self._hang()
        if self.body.get("stream"):
            await self._stream(send)
        else:
            await self._whole(send)

    async def _hang(self) -> None:
        """Wait until the client goes away (the caller is cancelled) or the server stops (drop it)."""
        await self.owner._closing.wait()
        raise Cut

    def _deltas(self) -> tuple[list[dict[str, Any]], int, bool]:
        """The content and tool-call deltas after the role chunk, the tokens they hold, and truncation."""
        units: list[tuple[dict[str, Any], bool]] = [({"content": p}, True) for p in pieces(self.reply.text)]
        for index, ((name, arguments), call_id) in enumerate(
            zip(self.reply.tool_calls, self.call_ids, strict=True)
        ):
            head = {
                "index": index,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            units.append(({"tool_calls": [head]}, False))
            units.extend(
                ({"tool_calls": [{"index": index, "function": {"arguments": p}}]}, True)
                for p in pieces(arguments)
            )
        limit, tokens = _limit(self.body), 0
        out: list[dict[str, Any]] = []
        for delta, is_token in units:
            if is_token:
                if limit is not None and tokens >= limit:
                    return out, tokens, True
                tokens += 1
            out.append(delta)
        return out, tokens, False

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.body["model"],
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self._include_usage():
            chunk["usage"] = None
        return chunk

    def _include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))

    def _usage(self, completion: int) -> dict[str, int]:
        prompt = prompt_tokens(self.body)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _finish(self, truncated: bool) -> str:
        if truncated:
            return "length"
        return "tool_calls" if self.reply.tool_calls else "stop"

    async def _stream(self, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-request-id", self.id.encode()),
                ],
            }
        )

        async def event(data: str) -> None:
            await send(
                {"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True}
            )

        deltas, tokens, truncated = self._deltas()
        await asyncio.sleep(self.ttft_s)
        first = {"role": "assistant", "content": "" if self.reply.text else None, "refusal": None}
        await event(json.dumps(self._chunk(first)))
        if self.rule.fault == "stall":
            await self._hang()
        pacer = Pacer(self.tps)
        for n, delta in enumerate(deltas):
            if self.rule.fault == "cut" and n == CUT_AFTER:
                raise Cut
            if n:
                await pacer.tick()
            await event(json.dumps(self._chunk(delta)))
        if self.rule.fault == "cut":
            raise Cut
        await event(json.dumps(self._chunk({}, self._finish(truncated))))
        if self._include_usage():
            usage = self._chunk({})
            usage.update(choices=[], usage=self._usage(tokens))
            await event(json.dumps(usage))
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _whole(self, send: Send) -> None:
        deltas, tokens, truncated = self._deltas()
        await asyncio.sleep(self.ttft_s + (tokens / self.tps if self.tps > 0 else 0.0))
        text = "".join(d.get("content", "") for d in deltas)
        calls: list[dict[str, Any]] = []
        for delta in deltas:
            for piece in delta.get("tool_calls", []):
                if "id" in piece:
                    calls.append(piece)
                else:
                    calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
        message: dict[str, Any] = {"role": "assistant", "content": text or None, "refusal": None}
        if calls:
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
        body = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.body["model"],
            "system_fingerprint": None,
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": self._finish(truncated)}
            ],
            "usage": self._usage(tokens),
        }
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"x-request-id", self.id.encode())]
        if self.rule.fault == "cut":
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": data[: len(data) // 2], "more_body": True})
            raise Cut
        headers.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}
