"""The chaos run (`make chaos`, part of `make bench`): minutes of mixed turns while services die.

Every service runs as its own process (`agentmesh serve`, as in tests/e2e/cli/test_faults.py) with short
leases. Workers keep turns going: plain replies, agent-invoke, delegate_parallel with three subagents,
cancels, and disconnect-and-resume. Each turn's session stream, and the live stream of each callee and
each running subagent card, is followed by a reader that reconnects with Last-Event-ID as a browser
does. Meanwhile a killer SIGKILLs a random service every few seconds and restarts it.

Every reply is scripted as numbered words (`p1 p2 ...`), so a reader's text shows exactly what it
missed (a gap) or saw twice (a duplicate). At the end, once every service is back, every session the
user has must settle: no message pending, no task working, no subagent queued or running (orphans).

Reported: turns started and how they ended, readers and how they ended, orphans, gaps, duplicates,
the longest silence before a reader's terminal event (and that reader: what it followed, how it
ended, the kills around its silence), kills per service. Writes OUT/chaos.json and
OUT/chaos.md (OUT: bench/results).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.databases import create_database, drop_database
from tests.mesh import (
    SERVICE_ORDER,
    ProcessMesh,
    SseReader,
    read_tree,
    start_process_mesh,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
WORK = ROOT / ".agentmesh" / "bench"

WORDS = 60  # words per reply
PACE = 25.0  # tokens a second: a reply takes a couple of seconds, long enough to be killed mid-way
KINDS = {"plain": 3, "invoke": 2, "parallel": 2, "cancel": 1.5, "resume": 1.5}


def words(prefix: str) -> str:
    return " ".join(f"{prefix}{i}" for i in range(1, WORDS + 1))


RULES: dict[str, Any] = {
    "rules": [
        {
            "system": r"\[general\]",
            "user": "^invoke",
            "after_tool": False,
            "tool_calls": [{"name": "agent-invoke", "arguments": {"agentSlug": "coder", "input": "callee"}}],
        },
        {
            "system": r"\[general\]",
            "user": "^parallel",
            "after_tool": False,
            "tool_calls": [
                {
                    "name": "delegate_parallel",
                    "arguments": {"tasks": [{"goal": f"part {i}", "agentSlug": "helper"} for i in (1, 2, 3)]},
                }
            ],
        },
        {"system": r"\[general\]", "after_tool": True, "text": words("a"), "tokens_per_second": PACE},
        {"system": r"\[general\]", "text": words("p"), "tokens_per_second": PACE},
        {"system": r"\[coder\]", "text": words("c"), "tokens_per_second": PACE},
        {"system": r"\[helper\]", "text": words("s"), "tokens_per_second": PACE},
    ],
}
NUMBERED = re.compile(r"\b([pacs])(\d+)\b")


@dataclass
class Followed:
    """One reader and what its text should be."""

    key: str  # session | a2a | subagent
    reader: SseReader
    prefix: str


@dataclass
class Tally:
    turns_started: int = 0
    turn_ends: Counter[str] = field(default_factory=Counter)
    end_messages: dict[str, str] = field(default_factory=dict)  # one message for each terminal code
    refused: Counter[str] = field(default_factory=Counter)  # POSTs answered without a turn (retried)
    locked: list[str] = field(default_factory=list)  # sessions that kept answering 409 past the bound: when
    followed: list[Followed] = field(default_factory=list)
    kills: Counter[str] = field(default_factory=Counter)
    kill_times: list[tuple[float, str]] = field(default_factory=list)  # (monotonic, service)
    sessions: set[str] = field(default_factory=set)


class Chaos:
    def __init__(self, mesh: ProcessMesh, args: argparse.Namespace, rng: random.Random) -> None:
        self.mesh, self.args, self.rng = mesh, args, rng
        self.tally = Tally()
        self.stop = asyncio.Event()
        self.background: set[asyncio.Task[None]] = set()
        self.bound_s = args.lease_s * 8  # how long a session may stay busy after its turn died

    def client(self, timeout: float = 60.0) -> httpx.AsyncClient:
        return self.mesh.http(timeout=timeout)

    async def worker(self) -> None:
        session = ""
        while not self.stop.is_set():
            kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
            if self.rng.random() < 0.4:
                session = ""  # a new chat now and then; otherwise the next turn of the same one
            session = await self.turn(kind, session) or session

    async def turn(self, kind: str, session: str) -> str:
        """Runs one turn to its end (through reconnects); returns its session id."""
        message = {"cancel": "plain", "resume": self.rng.choice(["plain", "invoke"])}.get(kind, kind)
        body: dict[str, Any] = {"agent": "general", "message": message}
        if session:
            body["sessionId"] = session
        deadline = time.monotonic() + self.bound_s
        while True:  # until the gateway takes the turn
            http = self.client()
            try:
                resp = await http.send(http.build_request("POST", "/api/chat", json=body), stream=True)
            except httpx.TransportError:
                await http.aclose()
                self.tally.refused["gateway away"] += 1
                resp = None
            if resp is not None and resp.status_code == 200:
                break
            if resp is not None:
                await resp.aread()
                self.tally.refused[str(resp.status_code)] += 1
                await resp.aclose()
                await http.aclose()
            if time.monotonic() > deadline or self.stop.is_set():
                if resp is not None and resp.status_code == 409:
                    self.tally.locked.append(f"{time.strftime('%H:%M:%S')} {session}")
                return ""
            await asyncio.sleep(0.3)
        self.tally.turns_started += 1
        deltas = 0
        children: set[str] = set()
        state = {"session": session}

        def on_event(event: dict[str, Any]) -> bool:
            nonlocal deltas
            if not state["session"] and event.get("traceId"):
                state["session"] = event["traceId"]
                reader.path = f"/api/sessions/{state['session']}/stream"
            if event["type"] == "a2a-task-started" and event["taskId"] not in children:
                children.add(event["taskId"])
                self.follow("a2a", f"/api/agents/a2a/stream?taskId={event['taskId']}", "c")
            if event["type"] == "subagent-update" and event["subagent"]["status"] == "running":
                sub = event["subagent"]["id"]
                if sub not in children:
                    children.add(sub)
                    self.follow("subagent", f"/api/subagents/{sub}/stream", "s")
            if event["type"] == "text-delta":
                deltas += 1
                if kind == "cancel" and deltas == 5:
                    task = asyncio.create_task(self.cancel(state["session"]))
                    self.background.add(task)
                    task.add_done_callback(self.background.discard)
                if kind == "resume" and deltas == 5:
                    return True  # drop the connection; the reader resumes from its last id
            return False

        path = f"/api/sessions/{session}/stream" if session else ""
        reader = SseReader(self.client, path, first=resp, reconnect=True, on_event=on_event)
        prefix = "a" if message in ("invoke", "parallel") else "p"
        self.tally.followed.append(Followed("session", reader, prefix))
        try:
            await reader.task
        finally:
            await http.aclose()
        if state["session"]:
            self.tally.sessions.add(state["session"])
        code = reader.end.get("code") or reader.end.get("type", "none")
        self.tally.turn_ends[code] += 1
        self.tally.end_messages.setdefault(code, str(reader.end.get("message", ""))[:200])
        if code != "done":
            await asyncio.sleep(0.5)  # a user reads the error before trying again
        return state["session"]

    def follow(self, key: str, path: str, prefix: str) -> None:
        self.tally.followed.append(Followed(key, SseReader(self.client, path, reconnect=True), prefix))

    async def cancel(self, session: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            async with self.client(timeout=10) as http:
                await http.post(f"/api/sessions/{session}/cancel")

    async def killer(self) -> None:
        every = self.args.kill_every_s
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.rng.uniform(every * 0.5, every * 1.5))
            if self.stop.is_set():
                return
            victim = self.rng.choice(self.args.victims)
            await self.mesh.kill(victim)
            self.tally.kills[victim] += 1
            self.tally.kill_times.append((time.monotonic(), victim))
            print(f"  {time.strftime('%H:%M:%S')} killed {victim}", flush=True)
            await asyncio.sleep(self.rng.uniform(0.2, 2.0))  # down for a while: chaos pacing, not a wait
            await self.mesh.start(victim)


def check_text(f: Followed) -> tuple[int, int]:
    """(gaps, duplicates) in a reader's numbered words: a word seen twice is a duplicate; a number
    skipped, or a reader that ended `done` short of the whole reply, is a gap."""
    numbers = [int(n) for p, n in NUMBERED.findall(f.reader.text) if p == f.prefix]
    dups = len(numbers) - len(set(numbers))
    want = list(range(1, len(set(numbers)) + 1))
    gaps = int(sorted(set(numbers)) != want)
    if f.reader.last == "done" and len(set(numbers)) != WORDS:
        gaps += 1
    return gaps, dups


async def orphans(mesh: ProcessMesh, sessions: set[str], bound_s: float) -> tuple[list[str], float]:
    """The rows still open once every service is back, after `bound_s` (and how long settling took)."""
    started = time.monotonic()
    left: list[str] = []
    while True:
        left = []
        for session in sorted(sessions):
            tree = await read_tree(mesh, session)
            left += ["trace unreachable"] if tree is None else [f"{session}: {r}" for r in tree.open_rows]
        if not left or time.monotonic() - started > bound_s:
            return left, time.monotonic() - started
        await asyncio.sleep(0.5)  # polling rows another service writes, with a bound


async def run(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    work = WORK / f"chaos-{backend}"
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("*.log"):
        old.unlink()
    database = redis_url = ""
    if backend == "postgres-redis":
        database = await create_database(args.database_url, "chaos")
        redis_url = args.redis_url
    mesh = await start_process_mesh(
        work, RULES, database_url=database, redis_url=redis_url, lease_s=args.lease_s
    )
    try:
        chaos = Chaos(mesh, args, rng)
        print(f"chaos on {backend}: {args.minutes} min, {args.workers} workers", flush=True)
        tasks = [asyncio.create_task(chaos.worker()) for _ in range(args.workers)]
        killer = asyncio.create_task(chaos.killer())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(chaos.stop.wait(), args.minutes * 60)
        chaos.stop.set()
        await killer
        for name in SERVICE_ORDER:  # every service is back before the end is judged
            if name not in mesh.procs:
                await mesh.start(name)
        # The turns under way finish (their readers reconnect to the restarted services), then every
        # reader of every callee and card they started; what has not ended by then counts as unended.
        finish_by = time.monotonic() + chaos.bound_s * 3
        _, pending = await asyncio.wait(tasks, timeout=chaos.bound_s * 2)
        late: set[asyncio.Task[None]] = set()
        if readers := [f.reader.task for f in chaos.tally.followed]:
            _, late = await asyncio.wait(readers, timeout=max(1.0, finish_by - time.monotonic()))
        for task in {*pending, *late}:
            task.cancel()
        left, settle_s = await orphans(mesh, chaos.tally.sessions, chaos.bound_s)
        return report(chaos.tally, backend, args, left, settle_s)
    finally:
        await mesh.stop()
        if database:
            await drop_database(args.database_url, database)


def report(
    tally: Tally, backend: str, args: argparse.Namespace, left: list[str], settle_s: float
) -> dict[str, Any]:
    gaps = dups = 0
    flawed: list[dict[str, Any]] = []  # the readers with a gap or a duplicate, to tell why
    ends: dict[str, Counter[str]] = {}
    longest: Followed | None = None  # the reader whose terminal event came after the longest silence
    unended = 0
    for f in tally.followed:
        g, d = check_text(f)
        gaps, dups = gaps + g, dups + d
        if g or d:
            flawed.append(_flawed(f))
        end = f.reader.end.get("code") or f.reader.end.get("type", "none") if f.reader.ended else "unended"
        ends.setdefault(f.key, Counter())[end] += 1
        if f.reader.ended:
            if longest is None or f.reader.silence_before_end > longest.reader.silence_before_end:
                longest = f
        else:
            unended += 1
    return {
        "backend": backend,
        "minutes": args.minutes,
        "workers": args.workers,
        "lease_s": args.lease_s,
        "kill_every_s": args.kill_every_s,
        "kills": dict(tally.kills),
        "turns_started": tally.turns_started,
        "turn_ends": dict(tally.turn_ends),
        "end_messages": tally.end_messages,
        "refused_and_retried": dict(tally.refused),
        "locked_sessions": len(tally.locked),
        "locked": tally.locked[:20],
        "readers": len(tally.followed),
        "reader_ends": {k: dict(v) for k, v in ends.items()},
        "readers_without_terminal": unended,
        "orphans": len(left),
        "orphan_rows": left[:20],
        "settle_s": round(settle_s, 1),
        "gaps": gaps,
        "duplicates": dups,
        "longest_wait_for_terminal_s": round(longest.reader.silence_before_end, 2) if longest else 0.0,
        "longest_wait": _longest_wait(longest, tally.kill_times) if longest is not None else None,
        "flawed_readers": flawed[:10],
    }


def _longest_wait(f: Followed, kill_times: list[tuple[float, str]]) -> dict[str, Any]:
    """The reader that waited longest for its terminal event: what it followed, how it ended, its
    connections, and the kills from 5 s before its silence began to its end (seconds before the end)."""
    end = f.reader.end["_t"]
    silence = f.reader.silence_before_end
    return {
        "key": f.key,
        "path": f.reader.path,
        "end": f.reader.end.get("code") or f.reader.end.get("type", ""),
        "connections": f.reader.connections,
        "events": len(f.reader.events),
        "silence_s": round(silence, 2),
        "kills_before_end_s": [
            [victim, round(end - t, 2)] for t, victim in kill_times if end - silence - 5.0 <= t <= end
        ],
    }


def _flawed(f: Followed) -> dict[str, Any]:
    """What a reader with a gap or a duplicate saw, in order across its reconnections: each event's id
    and its words (another event: its code or type in angle brackets)."""
    seen = [
        f"{e.get('_id', '')}:{e['textDelta'].strip()}"
        if e["type"] == "text-delta"
        else f"{e.get('_id', '')}:<{e.get('code') or e['type']}>"
        for e in f.reader.events
    ]
    return {"key": f.key, "path": f.reader.path, "connections": f.reader.connections, "events": seen[:200]}


def _services(names: str) -> list[str]:
    """--victims: service names of the mesh, comma-separated."""
    picked = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in picked if n not in SERVICE_ORDER]
    if unknown or not picked:
        wrong = f" (not {', '.join(unknown)})" if unknown else ""
        raise argparse.ArgumentTypeError(f"name services of {', '.join(SERVICE_ORDER)}{wrong}")
    return picked


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | minutes | kills | turns started | turns ended | readers | without terminal "
        "| orphans | gaps | duplicates | longest wait for terminal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ended = sum(r["turn_ends"].values())
        lines.append(
            f"| {r['backend']} | {r['minutes']} | {sum(r['kills'].values())} | {r['turns_started']} "
            f"| {ended} | {r['readers']} | {r['readers_without_terminal']} | {r['orphans']} | {r['gaps']} "
            f"| {r['duplicates']} | {r['longest_wait_for_terminal_s']} s |"
        )
    for r in results:
        if w := r.get("longest_wait"):
            kills = ", ".join(f"{victim} {s} s before" for victim, s in w["kills_before_end_s"]) or "none"
            lines.append(
                f"\n{r['backend']}: the longest wait, {w['silence_s']} s, was a {w['key']} reader "
                f"(`{w['path']}`) that ended `{w['end']}` after {w['events']} events on "
                f"{w['connections']} connection{'s' if w['connections'] != 1 else ''}; kills from 5 s "
                f"before its silence to its end: {kills}."
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--workers", type=int, default=8, help="turns running at once")
    p.add_argument("--kill-every-s", type=float, default=10.0, help="mean seconds between kills")
    p.add_argument("--lease-s", type=float, default=2.0)
    p.add_argument("--backends", default="postgres-redis,sqlite-memory")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument(
        "--victims",
        type=_services,
        default=list(SERVICE_ORDER),
        help=f"the services to kill, comma-separated (default: all of {','.join(SERVICE_ORDER)})",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--database-url",
        default=os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test").replace(
            "postgresql+asyncpg://", "postgresql://"
        ),
    )
    p.add_argument("--redis-url", default=os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = p.parse_args(argv)
    logging.getLogger("asyncio").setLevel(logging.ERROR)  # writes to a killed process's sockets
    results = [asyncio.run(run(args, b.strip())) for b in args.backends.split(",") if b.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "chaos.md").write_text(markdown(results))
    print(markdown(results))
    print(json.dumps(results, indent=2))
    must_be_zero = ("orphans", "gaps", "duplicates", "readers_without_terminal", "locked_sessions")
    return 1 if any(r[k] for r in results for k in must_be_zero) else 0


if __name__ == "__main__":
    sys.exit(main())
