"""HTTP to a registered peer's gateway (httpx): the one way any process of this mesh talks to another
mesh. Every request has timeouts, and takes no longer than what is left of the deadline of the call it
serves minus a margin (libs.deadlines); idempotent reads are retried (bounded, with backoff) on
connection failures and 502/503/504, writes never; redirects are never followed (a 3xx is an error);
answers are gzip-compressed on the wire and bounded in size after decompression; TLS is verified. The
peer's key is sent as `Authorization: Bearer` and never logged.

A peer that did not answer (refused, cut, timed out) is marked down: every request fails at once
(NotSent) until one background probe per peer (GET /healthz, first after `down_s`, then at doubling
intervals up to `probe_max_s`) finds it answering again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import httpx

from agentmesh.libs import deadlines, jsonbound
from agentmesh.libs.config import FederationSettings
from agentmesh.libs.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from agentmesh.libs.metrics import PeerMetrics
from agentmesh.libs.peers import Peer
from agentmesh.libs.retry import with_backoff

log = logging.getLogger(__name__)
RETRYABLE_STATUS = {502, 503, 504}


class PeerUnreachable(Unavailable):
    """No answer at the transport level (refused, reset, cut): retried on reads, the peer marked down."""


class NotSent(PeerUnreachable):
    """The request never left: no connection (or the peer is marked down). A write certainly did nothing."""


def transport_error(alias: str, exc: httpx.TransportError | httpx.TimeoutException) -> MeshError:
    """A failed exchange as our error: whether the request may have reached the peer matters to a write."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return NotSent(f"peer {alias!r} is unreachable ({type(exc).__name__})")
    if isinstance(exc, httpx.TimeoutException):
        return DeadlineExceeded(f"peer {alias!r} did not answer in time")
    return PeerUnreachable(f"peer {alias!r} did not answer ({type(exc).__name__})")


class PeerBusy(Unavailable):
    """The peer answered 502, 503 or 504: retried on reads."""


RETRIED = (PeerUnreachable, PeerBusy, DeadlineExceeded)


def _error_from(peer: Peer, status: int, body: bytes) -> MeshError:
    """The peer's JSON error, as our error class (its message prefixed with the peer)."""
    message = ""
    try:
        message = str(jsonbound.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError, jsonbound.BoundError):
        pass
    where = f"peer {peer.alias!r}"
    if status == 404:
        return NotFound(f"trace not found at {where}" + (f": {message}" if message else ""))
    if status in (401, 403):
        return PermissionDenied(f"{where} refused our credential ({status})")
    if status == 422:
        return InvalidArgument(f"{where}: {message or 'invalid request'}")
    if status == 409:
        return FailedPrecondition(f"{where}: {message or 'conflict'}")
    if 300 <= status < 400:
        return Unavailable(f"{where} answered with a redirect ({status}); redirects are not followed")
    cls = PeerBusy if status in RETRYABLE_STATUS else Unavailable
    return cls(f"{where} answered {status}" + (f": {message}" if message else ""))


class PeerClient:
    """One peer's HTTP client (a connection pool), opened on first use."""

    def __init__(
        self,
        peer: Peer,
        settings: FederationSettings,
        transport: httpx.AsyncBaseTransport | None = None,
        metrics: PeerMetrics | None = None,
    ):
        self.peer = peer
        self.settings = settings
        self.metrics = metrics or PeerMetrics()
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self.down_since: float | None = None  # monotonic time it was marked down; None: up
        self._probe: asyncio.Task[None] | None = None  # the one probe that finds a down peer back
        self.metrics.up.labels(peer.alias).set(1)

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            s = self.settings
            self._http = httpx.AsyncClient(
                base_url=self.peer.url,
                timeout=httpx.Timeout(s.timeout_s, connect=s.connect_timeout_s),
                follow_redirects=False,
                verify=True,
                trust_env=False,  # no proxy from the environment: the peer is dialled directly
                headers={"Accept-Encoding": "gzip", "User-Agent": "agentmesh-federation"},
                transport=self._transport,
            )
        return self._http

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = dict(extra or {})
        key = self.peer.api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    @staticmethod
    def trace_path(trace_id: str, suffix: str = "") -> str:
        return f"/api/traces/{quote(trace_id, safe='')}{suffix}"

    async def _read_body(self, resp: httpx.Response) -> bytes:
        limit = self.settings.max_response_bytes
        declared = resp.headers.get("content-length")
        if (
            declared
            and declared.isdigit()
            and int(declared) > limit
            and "gzip" not in resp.headers.get("content-encoding", "")
        ):
            raise ResourceExhausted(f"peer {self.peer.alias!r} answered more than {limit} bytes")
        chunks, size = [], 0
        async for chunk in resp.aiter_bytes():  # decompressed: a gzip bomb is cut at the limit too
            size += len(chunk)
            if size > limit:
                raise ResourceExhausted(f"peer {self.peer.alias!r} answered more than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    @property
    def is_down(self) -> bool:
        return self.down_since is not None

    def _check_up(self) -> None:
        if self.down_since is not None:
            ago = time.monotonic() - self.down_since
            raise NotSent(
                f"peer {self.peer.alias!r} did not answer a moment ago ({ago:.1f}s ago; it is probed "
                "in the background and dialled again once it answers)"
            )

    def mark_down(self) -> None:
        """The peer did not answer: requests fail at once until the probe finds it back (down_s 0: no
        memo)."""
        if self.settings.down_s <= 0:
            return
        if self.down_since is None:
            log.info("peer %s is marked down", self.peer.alias)
            self.down_since = time.monotonic()
            self.metrics.up.labels(self.peer.alias).set(0)
        if self._probe is None:
            self._probe = asyncio.get_running_loop().create_task(self._find_back())

    async def _find_back(self) -> None:
        delay = self.settings.down_s
        try:
            while True:
                await asyncio.sleep(delay)
                ok, why = await self.healthy(min(self.settings.timeout_s, max(delay, 1.0)))
                self.metrics.requests.labels(self.peer.alias, "PROBE", "ok" if ok else "unavailable").inc()
                if ok:
                    log.info("peer %s answers again", self.peer.alias)
                    self.down_since = None
                    self.metrics.up.labels(self.peer.alias).set(1)
                    return
                log.info("peer %s is still down (%s)", self.peer.alias, why)
                delay = min(delay * 2, max(self.settings.probe_max_s, self.settings.down_s))
        finally:
            self._probe = None

    def _budget(self) -> float | None:
        """What a request may take: the caller's deadline minus the margin (None: only its timeouts)."""
        return deadlines.budget(self.settings.deadline_margin_s)

    def _out_of_time(self, budget: float) -> DeadlineExceeded:
        self.mark_down()
        return DeadlineExceeded(
            f"peer {self.peer.alias!r} did not answer within {budget:.1f}s (what its caller's deadline left)"
        )

    async def _once(self, method: str, path: str, **kwargs: Any) -> Any:
        started = time.monotonic()
        outcome = "cancelled"  # cut short: the caller's budget ran out, or its caller went away
        try:
            answer = await self._exchange(method, path, **kwargs)
            outcome = "ok"
            return answer
        except MeshError as err:
            outcome = err.code_name
            raise
        finally:
            self.metrics.requests.labels(self.peer.alias, method, outcome).inc()
            self.metrics.seconds.labels(self.peer.alias, method).observe(time.monotonic() - started)

    async def _exchange(self, method: str, path: str, **kwargs: Any) -> Any:
        http = self._client()
        try:
            async with http.stream(method, path, headers=self._headers(), **kwargs) as resp:
                body = await self._read_body(resp)
        except (httpx.TimeoutException, httpx.TransportError) as exc:
            raise transport_error(self.peer.alias, exc) from exc
        if resp.status_code != 200 and resp.status_code != 201:
            raise _error_from(self.peer, resp.status_code, body)
        try:
            return jsonbound.loads(body)
        except (ValueError, jsonbound.BoundError) as exc:
            raise Unavailable(
                f"peer {self.peer.alias!r} answered something that is not JSON within our bounds"
            ) from exc

    async def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """An idempotent read: retried on connection failures, timeouts and 502/503/504, all of it
        within the caller's budget."""
        self._check_up()
        budget = self._budget()
        try:
            async with asyncio.timeout(budget):
                return await self._get(path, params)
        except TimeoutError:
            assert budget is not None
            raise self._out_of_time(budget) from None

    async def _get(self, path: str, params: dict[str, Any] | None) -> Any:
        def retrying(err: MeshError, _delay_s: float) -> None:
            log.info("retrying a read of peer %s: %s", self.peer.alias, err.message)

        try:
            return await with_backoff(
                lambda: self._once("GET", path, params=params),
                retry_on=RETRIED,
                retries=self.settings.read_retries,
                delay_s=self.settings.backoff_s,
                on_retry=retrying,
            )
        except RETRIED as err:
            if not isinstance(err, PeerBusy):
                self.mark_down()
            raise

    async def post(self, path: str, body: Any) -> Any:
        """A write: sent once (never retried, so it is never applied twice), within the caller's
        budget. A DeadlineExceeded or a PeerUnreachable that is not NotSent: it may have arrived."""
        self._check_up()
        budget = self._budget()
        try:
            async with asyncio.timeout(budget):
                return await self._once("POST", path, json=body)
        except TimeoutError:
            assert budget is not None
            raise self._out_of_time(budget) from None
        except (PeerUnreachable, DeadlineExceeded):
            self.mark_down()
            raise

    @asynccontextmanager
    async def stream(self, path: str, body: Any) -> AsyncIterator[httpx.Response]:
        """A POST answered with SSE (text/event-stream): the open response; errors as MeshError."""
        http = self._client()
        try:
            async with http.stream(
                "POST", path, json=body, headers=self._headers({"Accept": "text/event-stream"})
            ) as resp:
                if resp.status_code != 200:
                    raise _error_from(self.peer, resp.status_code, await self._read_body(resp))
                yield resp
        except (httpx.TimeoutException, httpx.TransportError) as exc:
            raise transport_error(self.peer.alias, exc) from exc

    async def healthy(self, timeout_s: float) -> tuple[bool, str]:
        """`agentmesh peers check`: does the gateway answer GET /healthz within the timeout."""
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._client().get("/healthz")
            if resp.status_code == 200:
                return True, "ok"
            return False, f"HTTP {resp.status_code}"
        except TimeoutError:
            return False, f"no answer within {timeout_s:g}s"
        except httpx.HTTPError as exc:
            return False, type(exc).__name__


class PeerClients:
    """A PeerClient per registered peer."""

    def __init__(
        self,
        settings: FederationSettings,
        transport: httpx.AsyncBaseTransport | None = None,
        metrics: PeerMetrics | None = None,
    ):
        self.settings = settings
        self.transport = transport
        self.metrics = metrics or PeerMetrics()
        self._by_alias: dict[str, PeerClient] = {}

    def of(self, peer: Peer) -> PeerClient:
        client = self._by_alias.get(peer.alias)
        if client is None:
            client = self._by_alias[peer.alias] = PeerClient(
                peer, self.settings, self.transport, self.metrics
            )
        return client

    async def close(self) -> None:
        clients, self._by_alias = list(self._by_alias.values()), {}
        for c in clients:
            await c.close()
