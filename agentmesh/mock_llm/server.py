"""A scripted OpenAI-compatible Chat Completions server (Starlette on uvicorn) for the demo and the tests."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentmesh.libs import embedded_http
from agentmesh.mock_llm.completion import Completion, QuietCut
from agentmesh.mock_llm.rules import ChatRequestView, Rule, RulesError, RuleSet, build_reply, parse_rules
from agentmesh.mock_llm.validation import BadRequest, error_response, validate

log = logging.getLogger(__name__)

RulesInput = str | bytes | dict[str, Any] | list[Any] | RuleSet
_LOG_SIZE = 10_000  # request bodies kept for /_mock/requests (the oldest go first)


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
        if not any(isinstance(f, QuietCut) for f in quiet.filters):
            quiet.addFilter(QuietCut())
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

    async def _completions(self, request: Request) -> Response | Completion:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error_response(
                400, "The request body is not valid JSON.", "invalid_request_error", "invalid_json"
            )
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
            validate(body)
        except BadRequest as exc:
            return error_response(400, exc.message, "invalid_request_error", exc.code, exc.param)
        view = ChatRequestView.of(body)
        rule, groups = self._rules.select(view)
        entry["rule"] = rule.name
        return Completion(self, body, rule, build_reply(rule, view.variables(groups)))

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
                return error_response(
                    408, f"fewer than {wait_for} requests arrived in time", "timeout", "timeout"
                )
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
            return error_response(400, str(exc), "invalid_request_error", "invalid_rules")
        return JSONResponse({"rules": len(self._rules.rules)})


def _as_rules(rules: RulesInput) -> RuleSet:
    return rules if isinstance(rules, RuleSet) else parse_rules(rules)
