"""The model: Chat Completions through the real `openai` client, streamed, tool calls reassembled."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx2
import openai
import orjson
from openai import AsyncOpenAI

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import telemetry
from agentmesh.libs.config import LLMSettings
from agentmesh.libs.errors import ModelError, ModelTimeout, ModelUnreachable
from agentmesh.libs.metrics import RuntimeMetrics

log = logging.getLogger(__name__)
YIELD_EVERY_S = 0.002
# A pooled connection idle this long is let go: before a server that closes idle ones after 5 s
# (uvicorn's default, under many OpenAI-compatible servers, the scripted one too) closes it under us.
KEEPALIVE_S = 4.0
# Sends of a request the server hung up on before answering (a pooled connection it had just closed):
# at 1,000 sessions the loop picked two such connections in a row (2 of 1,000 turns, bench C).
HUNG_UP_ATTEMPTS = 3
FINISH_REASONS = {
    "stop": ev.FINISH_REASON_STOP,
    "length": ev.FINISH_REASON_LENGTH,
    "tool_calls": ev.FINISH_REASON_TOOL_CALLS,
    "function_call": ev.FINISH_REASON_TOOL_CALLS,
    "content_filter": ev.FINISH_REASON_CONTENT_FILTER,
}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class Step:
    """One model call: text, reasoning, tool calls, why it stopped, what it cost."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: int = ev.FINISH_REASON_UNSPECIFIED
    input_tokens: int = 0
    output_tokens: int = 0
    model: str = ""


class LLM:
    def __init__(
        self, settings: LLMSettings, client: AsyncOpenAI | None = None, metrics: RuntimeMetrics | None = None
    ) -> None:
        self.metrics = metrics or RuntimeMetrics()
        self.client = client or AsyncOpenAI(
            base_url=settings.base_url,
            api_key=settings.api_key,
            timeout=settings.request_timeout_s,
            max_retries=settings.max_retries,
            # aiohttp under the client: its C parser reads a streamed body for a fraction of the
            # pure-Python HTTP/1.1 stack's CPU per chunk (the runtime's largest share per token)
            http_client=openai.DefaultAioHttpClient(
                limits=httpx2.Limits(
                    max_connections=1000, max_keepalive_connections=100, keepalive_expiry=KEEPALIVE_S
                )
            ),
        )
        # The client imports its chat resources on first use (tens of ms of module and model set-up):
        # here, at start, instead of in the first turn's time to first token.
        _ = self.client.chat.completions.with_streaming_response

    async def close(self) -> None:
        await self.client.close()

    async def step(
        self,
        *,
        model: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        max_tokens: int,
        on_text: Callable[[str], object],
        on_reasoning: Callable[[str], object],
    ) -> Step:
        """Streams one completion; calls on_text/on_reasoning per delta; returns the whole step."""
        # The messages and tools go in the body as they are (`extra_body`, which takes precedence over
        # the named parameters): the client's parameter transform would walk every message and tool
        # schema of every request (most of its CPU with a long history), and ours are plain JSON.
        body: dict[str, Any] = {"messages": messages}
        if tools:
            body["tools"] = tools
        kwargs: dict[str, Any] = {"extra_body": body}
        with telemetry.model_span(model, str(self.client.base_url)) as span:
            kwargs["extra_headers"] = telemetry.headers()  # the model server may join the trace
            out = await self._step(model, max_tokens, on_text, on_reasoning, kwargs)
            span.set_attribute("gen_ai.usage.input_tokens", out.input_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", out.output_tokens)
            return out

    async def _step(
        self,
        model: str,
        max_tokens: int,
        on_text: Callable[[str], object],
        on_reasoning: Callable[[str], object],
        kwargs: dict[str, Any],
    ) -> Step:
        out = Step(model=model)
        texts: list[str] = []  # joined at the end: `+=` on an attribute copies the whole reply each time
        reasonings: list[str] = []
        calls: dict[int, ToolCall] = {}
        next_yield = 0.0
        sent = time.monotonic()
        first = 0.0  # when the first token (text, reasoning or a tool call's) arrived
        deltas = 0
        outcome = "error"
        try:
            # The openai client makes the request (URL, headers, retries, timeouts, HTTP errors); the
            # chunks it would turn into pydantic models one by one (about 40 % of this process's CPU
            # at 20 tokens/s) are read as JSON here instead (`_chunks`).
            # (The messages are in the body: extra_body.)
            request = {"model": model, "messages": [], "max_tokens": max_tokens, **kwargs}
            async with contextlib.AsyncExitStack() as stack:
                response = await self._open(stack, request)
                async for chunk in _chunks(response):
                    usage = chunk.get("usage")
                    if usage:
                        out.input_tokens = usage.get("prompt_tokens") or 0
                        out.output_tokens = usage.get("completion_tokens") or 0
                    if chunk.get("model"):
                        out.model = chunk["model"]
                    for choice in chunk.get("choices") or ():
                        delta = choice.get("delta") or {}
                        content = _text(delta.get("content"))
                        tool_calls = delta.get("tool_calls")
                        reasoning = _text(delta.get("reasoning_content") or delta.get("reasoning"))
                        if content or tool_calls or reasoning:
                            deltas += 1
                            if not first:
                                first = time.monotonic()
                                self.metrics.ttft.labels(model).observe(first - sent)
                        if reasoning:
                            reasonings.append(reasoning)
                            on_reasoning(reasoning)
                        if content:
                            texts.append(content)
                            on_text(content)
                        for tc in tool_calls or ():
                            call = calls.setdefault(tc.get("index", 0), ToolCall(id="", name=""))
                            if tc.get("id"):
                                call.id = tc["id"]
                            function = tc.get("function") or {}
                            if function.get("name"):
                                call.name += _text(function["name"])
                            if function.get("arguments"):
                                call.arguments += _text(function["arguments"])
                        if choice.get("finish_reason"):
                            out.finish_reason = FINISH_REASONS.get(
                                choice["finish_reason"], ev.FINISH_REASON_STOP
                            )
                    # A fast model fills the socket buffer: without a pause the loop would parse the
                    # whole reply before the sink's writer ever ran. Let it run at the first delta, then
                    # every few milliseconds (so deltas still travel in batches).
                    now = time.monotonic()
                    if now >= next_yield and (texts or reasonings):
                        next_yield = now + YIELD_EVERY_S
                        await asyncio.sleep(0)
            outcome = "ok"
        except openai.APITimeoutError as exc:
            if _hung_up(exc):  # the transport calls any closed connection a timeout: it is not one
                raise ModelError(f"model {model} failed: the model server closed the connection") from exc
            if _unreachable(exc):  # aiohttp's refused connection reaches the client as a timeout too
                outcome = "unreachable"
                raise _unreachable_error(model, exc) from exc
            outcome = "timeout"
            raise ModelTimeout(f"model {model} timed out") from exc
        except openai.APIStatusError as exc:
            raise ModelError(f"model {model} failed with HTTP {exc.status_code}: {exc.message}") from exc
        except openai.APIError as exc:
            if _unreachable(exc):
                outcome = "unreachable"
                raise _unreachable_error(model, exc) from exc
            log.warning("model request failed", extra={"model": model, "error": _chain(exc)})
            raise ModelError(f"model {model} failed: the connection to the model server broke") from exc
        except ValueError as exc:  # a chunk that is not JSON
            raise ModelError(f"model {model} sent a chunk that is not JSON: {exc}") from exc
        except Exception as exc:
            # While the body streams, the HTTP library's own errors come through unwrapped (the
            # client maps those of the request alone): a read timeout, a connection that broke.
            if not _from_transport(exc):
                raise
            log.warning("model request failed", extra={"model": model, "error": _chain(exc)})
            if _timed_out(exc) and not _hung_up(exc):
                outcome = "timeout"
                raise ModelTimeout(f"model {model} timed out") from exc
            raise ModelError(f"model {model} failed: the connection to the model server broke") from exc
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            out.content, out.reasoning = "".join(texts), "".join(reasonings)
            self._observe(model, outcome, out, first, deltas)
        out.tool_calls = [calls[i] for i in sorted(calls)]
        if not out.finish_reason:
            raise ModelError(f"model {model} ended the stream without a finish reason")
        return out

    async def _open(self, stack: contextlib.AsyncExitStack, request: dict[str, Any]) -> Any:
        """The streamed response to `request`, its context held by `stack`. A pooled connection that the
        model server had closed already (it hangs up before a byte of an answer: under load the loop
        may reuse it before it sees the close) gets the request again, up to HUNG_UP_ATTEMPTS sends."""
        for attempt in range(HUNG_UP_ATTEMPTS):
            manager = self.client.chat.completions.with_streaming_response.create(  # type: ignore[call-overload]
                stream=True, stream_options={"include_usage": True}, **request
            )
            try:
                response = await manager.__aenter__()
            except openai.APIConnectionError as exc:
                if attempt == HUNG_UP_ATTEMPTS - 1 or not _hung_up(exc):
                    raise
                log.info(
                    "the model server hung up on a request; sending it again",
                    extra={"error": repr(exc.__cause__)},
                )
                continue
            stack.push_async_exit(manager)
            return response
        raise AssertionError("unreachable")

    def _observe(self, model: str, outcome: str, out: Step, first: float, deltas: int) -> None:
        m = self.metrics
        m.model_calls.labels(model, outcome).inc()
        if out.input_tokens or out.output_tokens:
            m.tokens.labels(model, "input").inc(out.input_tokens)
            m.tokens.labels(model, "output").inc(out.output_tokens)
        tokens = out.output_tokens or deltas
        elapsed = time.monotonic() - first if first else 0.0
        if outcome == "ok" and tokens > 1 and elapsed > 0:
            m.tokens_per_second.labels(model).observe((tokens - 1) / elapsed)  # the pace after the first


async def _chunks(response: Any) -> AsyncIterator[dict[str, Any]]:
    """The Chat Completions chunks of a streamed response (Server-Sent Events, `data: [DONE]` last), as
    dicts; an error the server sends inside the stream is raised as ModelError, as the openai client would."""
    data: list[str] = []
    event = ""
    async for line in _lines(response):
        if line:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data.append(value)
            elif name == "event":
                event = value
            continue
        if not data:
            event = ""
            continue
        text, data = "\n".join(data), []
        if text == "[DONE]":
            return
        chunk = orjson.loads(text)
        if event == "error" or (isinstance(chunk, dict) and chunk.get("error")):
            error = chunk.get("error") if isinstance(chunk, dict) else None
            message = error.get("message") if isinstance(error, dict) else error
            raise ModelError(f"the model server sent an error: {message or text[:200]}")
        event = ""
        yield chunk


async def _lines(response: Any) -> AsyncIterator[str]:
    """The lines of the body, then an empty one: a last event without its blank line still ends."""
    async for line in response.iter_lines():
        yield line
    yield ""


_TRANSPORT = (
    "aiohttp",
    "httpx",
    "httpx2",
    "httpcore",
    "anyio",
    "h11",
    "ssl",
)  # under the openai client (httpx2 from openai 3, over aiohttp)


def _from_transport(exc: BaseException) -> bool:
    """An error of the HTTP stack the openai client reads with (whichever of httpx or httpx2 it uses)."""
    return isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in _TRANSPORT


def _hung_up(exc: BaseException) -> bool:
    """The server closed (or reset) an open connection instead of answering: aiohttp's error somewhere
    under the openai client's one (a connection that could not be opened is not this)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, aiohttp.ServerDisconnectedError) or (
            isinstance(seen, aiohttp.ClientOSError) and not isinstance(seen, aiohttp.ClientConnectorError)
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _text(value: Any) -> Any:
    """A model's text with U+0000 as U+FFFD: no database of the mesh stores NUL, and a reply is not
    refused for one character (docs/http-api.md#json-bounds)."""
    return value.replace("\x00", "\ufffd") if isinstance(value, str) and "\x00" in value else value


_TLS_FAILURES = (aiohttp.ClientConnectorCertificateError, aiohttp.ClientConnectorSSLError)  # reached


def _unreachable(exc: BaseException) -> bool:
    """The connection to the model server could not be opened at all: refused, no route, unknown host
    (a connection that timed out while opening is a timeout, one that closed later a model error)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError | socket.gaierror) or (
            isinstance(seen, aiohttp.ClientConnectorError)
            and not isinstance(seen.os_error, TimeoutError)
            and not isinstance(seen, _TLS_FAILURES)
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _chain(exc: BaseException) -> str:
    """What the transport said, cause by cause, for the log (never for the user: it names addresses)."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 6:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return " <- ".join(parts)[:2000]


def _unreachable_error(model: str, exc: BaseException) -> ModelUnreachable:
    """The user's words for a model server that cannot be reached; the transport's words go to the log
    (one line for the request, after the client's own retries)."""
    log.warning("model server unreachable", extra={"model": model, "error": _chain(exc)})
    return ModelUnreachable(f"model {model} could not be reached: the model server is not answering")


def _timed_out(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or any("Timeout" in c.__name__ for c in type(exc).__mro__)
