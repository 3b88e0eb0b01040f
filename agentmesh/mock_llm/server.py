"""A scripted OpenAI-compatible Chat Completions server (Starlette on uvicorn) for the demo and the tests."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import secrets
import time
from collections import deque
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from agentmesh.libs import embedded_http
from agentmesh.mock_llm.rules import (
    ChatRequestView,
    Reply,
    Rule,
    RulesError,
    RuleSet,
    build_reply,
    content_text,
    parse_rules,
    pieces,
    word_count,
)

log = logging.getLogger(__name__)

RulesInput = str | bytes | dict[str, Any] | list[Any] | RuleSet
_ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_LOG_SIZE = 10_000  # request bodies kept for /_mock/requests (the oldest go first)
_CUT_AFTER = 3  # content/argument deltas a `cut` stream sends before the connection drops


class _Cut(Exception):
    """Raised inside a started response to make uvicorn drop the connection."""


class _QuietCut(logging.Filter):
    """Keeps the deliberate connection drops of `cut` out of uvicorn's error log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _Cut))


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def _error(status: int, message: str, type_: str, code: str | None, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _validate(body: Any) -> None:
    """Reject what the OpenAI API rejects (a useful subset), with the same kind of 400 errors."""
    if not isinstance(body, dict):
        raise _BadRequest("The request body must be a JSON object.")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise _BadRequest("you must provide a model parameter", "model", "missing_required_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("'messages' must be a non-empty array.", "messages", "invalid_value")
    pending: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _BadRequest(f"Invalid type for '{where}': expected an object.", where, "invalid_type")
        role = message.get("role")
        if role not in _ROLES:
            raise _BadRequest(f"Invalid value: '{role}'. Supported values are: {_ROLES}.", f"{where}.role")
        if pending and role != "tool":
            raise _BadRequest(
                "An assistant message with 'tool_calls' must be followed by tool messages responding to "
                "each 'tool_call_id'. The following tool_call_ids did not have response messages: "
                f"{sorted(pending)}",
                f"{where}.role",
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _BadRequest(f"Invalid type for '{where}.content'.", f"{where}.content", "invalid_type")
        if role == "assistant":
            calls = message.get("tool_calls") or []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if (
                    not isinstance(call.get("id"), str)
                    or call.get("type") != "function"
                    or not isinstance(fn, dict)
                    or not isinstance(fn.get("name"), str)
                    or not isinstance(fn.get("arguments"), str)
                ):
                    raise _BadRequest(
                        "A tool call needs id, type 'function' and function {name, arguments (a string)}.",
                        f"{where}.tool_calls[{j}]",
                    )
            if content is None and not calls:
                raise _BadRequest(f"Missing content in '{where}'.", f"{where}.content")
            pending = {call["id"] for call in calls}
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise _BadRequest(f"Missing 'tool_call_id' in '{where}'.", f"{where}.tool_call_id")
            if call_id not in pending:
                raise _BadRequest(
                    "Invalid parameter: messages with role 'tool' must be a response to a preceeding message "
                    "with 'tool_calls'.",
                    f"{where}.role",
                )
            pending.discard(call_id)
        elif content is None:
            raise _BadRequest(f"Missing content in '{where}'.", f"{where}.content")
    if pending:
        raise _BadRequest(
            f"The tool calls {sorted(pending)} of the last assistant message have no tool messages.",
            "messages",
        )
    if not isinstance(body.get("stream", False), bool):
        raise _BadRequest("'stream' must be a boolean.", "stream", "invalid_type")
    if body.get("stream_options") is not None and not body.get("stream"):
        raise _BadRequest(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options"
        )
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise _BadRequest(f"'{key}' must be a positive integer.", key, "invalid_value")
    if body.get("n", 1) != 1:
        raise _BadRequest("This server returns one choice only (n=1).", "n", "unsupported_value")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _BadRequest("'tools' must be an array.", "tools", "invalid_type")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if tool.get("type") != "function" or not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
                raise _BadRequest(
                    f"Invalid tool: expected type 'function' and a name matching {_TOOL_NAME.pattern}.",
                    f"tools[{i}]",
                )


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


class _Pacer:
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


class _Completion:
    """The ASGI response of one chat completion: a fault, an SSE stream or one JSON body."""

    def __init__(self, owner: MockLLM, body: dict[str, Any], rule: Rule, reply: Reply) -> None:
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
            await _error(429, message, "requests", "rate_limit_exceeded")(scope, _no_receive, send)
            return
        if rule.fault == "http_500":
            message = "The server had an error while processing your request (scripted fault)."
            await _error(500, message, "server_error", "internal_error")(scope, _no_receive, send)
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
        raise _Cut

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
        pacer = _Pacer(self.tps)
        for n, delta in enumerate(deltas):
            if self.rule.fault == "cut" and n == _CUT_AFTER:
                raise _Cut
            if n:
                await pacer.tick()
            await event(json.dumps(self._chunk(delta)))
        if self.rule.fault == "cut":
            raise _Cut
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
            raise _Cut
        headers.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


class MockLLM:
    """The scripted model server: rules, timing, request log and in-flight stats, served by uvicorn.

    Timing precedence: a rule's `ttft_ms`/`tokens_per_second`, then the values given here (CLI/env),
    then the rules document's top-level values, then 0 (no delay).
    """

    def __init__(
        self,
        rules: RulesInput | None = None,
        *,
        ttft_ms: float | None = None,
        tokens_per_second: float | None = None,
    ) -> None:
        self.ttft_ms = ttft_ms
        self.tokens_per_second = tokens_per_second
        self._rules = parse_rules({}) if rules is None else _as_rules(rules)
        self._log: deque[dict[str, Any]] = deque(maxlen=_LOG_SIZE)
        self._logged = asyncio.Condition()
        self._index = itertools.count()
        self._in_flight = self._max_in_flight = self._total = 0
        self._closing = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._server: embedded_http.EmbeddedServer | None = None
        self.port = 0
        self.host = "127.0.0.1"
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._completions, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/_mock/requests", self._requests, methods=["GET"]),
                Route("/_mock/stats", self._stats, methods=["GET"]),
                Route("/_mock/reset", self._reset, methods=["POST"]),
                Route("/_mock/rules", self._set_rules, methods=["POST"]),
            ]
        )

    @classmethod
    def from_file(cls, path: str | Path, **timing: float | None) -> MockLLM:
        return cls(Path(path).read_text(encoding="utf-8"), **timing)

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, e.g. http://127.0.0.1:PORT/v1."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def url(self) -> str:
        """The server root (where /_mock/... lives)."""
        return f"http://{self.host}:{self.port}"

    # --- Python API -------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Serve on host:port (0: a free port) in the running event loop; returns once accepting."""
        self._closing = asyncio.Event()
        quiet = logging.getLogger("uvicorn.error")
        if not any(isinstance(f, _QuietCut) for f in quiet.filters):
            quiet.addFilter(_QuietCut())
        try:
            self._server = await embedded_http.serve(self.app, host, port, lifespan="off", ws="none")
        except RuntimeError as exc:
            raise RuntimeError(f"mock LLM could not start on {host}:{port}") from exc
        self.host, self.port = host, self._server.port

    async def stop(self) -> None:
        """Stop serving: stalled replies are dropped, then uvicorn shuts down."""
        if self._server is None:
            return
        self._closing.set()
        await self._server.stop()
        self._server = None

    def set_rules(self, rules: RulesInput) -> None:
        """Replace the rules (YAML/JSON text, a mapping, a list of rules or a parsed RuleSet)."""
        self._rules = _as_rules(rules)

    @property
    def rules(self) -> RuleSet:
        return self._rules

    def requests(self) -> list[dict[str, Any]]:
        """The JSON bodies posted to /v1/chat/completions, in order."""
        return [entry["body"] for entry in self._log]

    def request_log(self) -> list[dict[str, Any]]:
        """The full log entries: index, received_at (epoch seconds), rule (matched rule name) and body."""
        return list(self._log)

    async def wait_requests(self, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Wait until at least `count` completion requests were received; their bodies."""
        async with self._logged:
            await asyncio.wait_for(self._logged.wait_for(lambda: len(self._log) >= count), timeout)
        return self.requests()

    async def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait until no completion is in flight (e.g. the server saw a cancelled client go away)."""
        await asyncio.wait_for(self._idle.wait(), timeout)

    def stats(self) -> dict[str, int]:
        return {"in_flight": self._in_flight, "max_in_flight": self._max_in_flight, "total": self._total}

    def reset(self) -> None:
        """Clear the request log and the stats (max_in_flight restarts from the current in_flight)."""
        self._log.clear()
        self._index = itertools.count()
        self._max_in_flight = self._in_flight
        self._total = 0

    def timing(self, rule: Rule) -> tuple[float, float]:
        """(time to first token in seconds, tokens per second) for a rule."""

        def pick(*values: float | None) -> float:
            return next((float(v) for v in values if v is not None), 0.0)

        ttft = pick(rule.ttft_ms, self.ttft_ms, self._rules.ttft_ms)
        return ttft / 1000, pick(
            rule.tokens_per_second, self.tokens_per_second, self._rules.tokens_per_second
        )

    def _enter(self) -> None:
        self._in_flight += 1
        self._total += 1
        self._max_in_flight = max(self._max_in_flight, self._in_flight)
        self._idle.clear()

    def _leave(self) -> None:
        self._in_flight -= 1
        if not self._in_flight:
            self._idle.set()

    # --- HTTP -------------------------------------------------------------------------------------

    async def _completions(self, request: Request) -> Response | _Completion:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "The request body is not valid JSON.", "invalid_request_error", "invalid_json")
        entry: dict[str, Any] = {
            "index": next(self._index),
            "received_at": time.time(),
            "rule": None,
            "body": body,
        }
        async with self._logged:
            self._log.append(entry)
            self._logged.notify_all()
        try:
            _validate(body)
        except _BadRequest as exc:
            return _error(400, exc.message, "invalid_request_error", exc.code, exc.param)
        view = ChatRequestView.of(body)
        rule, groups = self._rules.select(view)
        entry["rule"] = rule.name
        return _Completion(self, body, rule, build_reply(rule, view.variables(groups)))

    async def _models(self, request: Request) -> Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "agentmesh"} for m in self._rules.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def _requests(self, request: Request) -> Response:
        wait_for = request.query_params.get("wait_for")
        if wait_for is not None:
            try:
                await self.wait_requests(int(wait_for), float(request.query_params.get("timeout", "5")))
            except TimeoutError:
                return _error(408, f"fewer than {wait_for} requests arrived in time", "timeout", "timeout")
        return JSONResponse({"requests": self.request_log()})

    async def _stats(self, request: Request) -> Response:
        return JSONResponse(self.stats())

    async def _reset(self, request: Request) -> Response:
        self.reset()
        return JSONResponse(self.stats())

    async def _set_rules(self, request: Request) -> Response:
        try:
            self.set_rules(await request.body())
        except RulesError as exc:
            return _error(400, str(exc), "invalid_request_error", "invalid_rules")
        return JSONResponse({"rules": len(self._rules.rules)})


def _as_rules(rules: RulesInput) -> RuleSet:
    return rules if isinstance(rules, RuleSet) else parse_rules(rules)
