"""The load generator of scenario C: K worker processes (spawned once, reused for every phase), each
one asyncio loop with one httpx client whose pool holds a connection per session it drives.

A worker starts each of its sessions at its scheduled epoch time against its base URL (a target with
several gateways, the scale-out mesh, has its sessions spread over them in turn), streams it with the target's
client (bench/clients.py) and returns the `Stream`s with its own health: CPU seconds, wall
seconds and the lag of its event loop (a 20 ms ticker's overshoot). A loop that lags or a worker
near a whole core means the load generator, not the target, set the pace: the report says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import httpx

from bench import clients
from bench.clients import Stream

_TICK_S = 0.02


@dataclass
class Job:
    target: str  # direct | mesh | langgraph
    base_urls: list[str]  # one per tag: the gateway (or server) that session talks to
    headers: dict[str, str]
    agent: str
    tags: list[str]
    starts: list[float]  # epoch seconds, one per tag
    deadline: float  # epoch seconds: a stream still open then is cut and counted as `deadline`


@dataclass
class JobResult:
    streams: list[Stream]
    cpu_s: float
    wall_s: float
    lag_ms: list[float] = field(default_factory=list)


def run_job(job: Job) -> JobResult:
    """Entry point of a worker process."""
    return asyncio.run(_run(job))


def warm() -> int:
    """A no-op that makes the pool start its processes (and import httpx) before the first phase."""
    return multiprocessing.current_process().pid or 0


async def _one(http: httpx.AsyncClient, job: Job, out: Stream, start: float) -> None:
    delay = start - time.time()
    if delay > 0:
        await asyncio.sleep(delay)
    if job.target == "mesh":
        await clients.mesh(http, out, job.agent)
    elif job.target == "langgraph":
        await clients.langgraph(http, out)
    else:
        await clients.direct_raw(http, out)


async def _run(job: Job) -> JobResult:
    cpu0, wall0 = time.process_time(), time.time()
    lag: list[float] = []
    loop = asyncio.get_running_loop()

    async def ticker() -> None:
        while True:
            before = loop.time()
            await asyncio.sleep(_TICK_S)
            lag.append(1000 * (loop.time() - before - _TICK_S))

    streams = [Stream(target=job.target, tag=tag) for tag in job.tags]
    read_s = max(60.0, job.deadline - time.time())
    async with contextlib.AsyncExitStack() as stack:
        https = {
            url: await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=url,
                    headers=job.headers,
                    limits=clients.limits(job.base_urls.count(url) + 8),
                    timeout=clients.timeout(read_s),
                )
            )
            for url in dict.fromkeys(job.base_urls)
        }
        tick = asyncio.create_task(ticker())
        tasks = [
            asyncio.create_task(_one(https[url], job, out, start))
            for out, start, url in zip(streams, job.starts, job.base_urls, strict=True)
        ]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, job.deadline - time.time()))
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        tick.cancel()
    for out in streams:
        if out.error is None and not out.end:
            out.error = "deadline"
    return JobResult(
        streams=streams, cpu_s=time.process_time() - cpu0, wall_s=time.time() - wall0, lag_ms=lag
    )


class LoadGenerator:
    """K worker processes; `run` spreads a phase's sessions over them round-robin."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        self.pool = ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"))
        list(self.pool.map(_warm_wait, range(procs)))

    def run(
        self,
        target: str,
        base_urls: list[str],
        headers: dict[str, str],
        agent: str,
        tags: list[str],
        starts: list[float],
        deadline: float,
    ) -> list[JobResult]:
        """Session i talks to base_urls[i % len(base_urls)]."""
        k = max(1, min(self.procs, len(tags)))
        urls = [base_urls[i % len(base_urls)] for i in range(len(tags))]
        jobs = [Job(target, urls[i::k], headers, agent, tags[i::k], starts[i::k], deadline) for i in range(k)]
        return list(self.pool.map(run_job, jobs))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _warm_wait(_: int) -> int:
    time.sleep(0.3)  # long enough that every worker process gets one of these, not one worker all
    return warm()
