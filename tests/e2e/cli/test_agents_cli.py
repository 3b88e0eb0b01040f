"""`agentmesh agents list|show|apply -f|delete` as a user runs it (a subprocess) against a whole mesh
on both backend pairs: agents kept in a YAML file are applied (created, then configured or left
unchanged), used by the next chat turn, refused with the gateway's message when invalid or stale."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.mesh import BACKENDS, Mesh, chat, system_of


@dataclass
class Result:
    code: int
    out: str
    err: str


# A mesh per test with a user of the test's own: the PostgreSQL database is shared by the run's meshes.
pytestmark = pytest.mark.mesh(
    backends=BACKENDS, scope="function", rules={"rules": [], "default": {"text": "ok"}}, user="cli"
)


async def agents(mesh: Mesh, *args: str, stdin: str | None = None, key: str | None = None) -> Result:
    """`agentmesh agents ARGS --url ... --api-key ...` in its own process."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agentmesh.cli",
        "agents",
        *args,
        "--url",
        mesh.url,
        "--api-key",
        mesh.api_key if key is None else key,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


FILE = """
agents:
  - slug: reviewer
    name: Reviewer
    systemPrompt: Review the code you are given.
    tools: [agent-invoke]
    invoke: {allowedCallees: [coder], maxParallel: 2}
  - slug: planner
    name: Planner
    description: Splits work.
    tools: [delegate_parallel]
    subagentConfig: {enabled: true, maxConcurrent: 2, allowedPresetAgentIds: [reviewer]}
"""


async def get(mesh: Mesh, slug: str) -> dict[str, Any]:
    async with mesh.http() as http:
        resp = await http.get(f"/api/agents/{slug}")
    assert resp.status_code == 200, resp.text
    return dict(resp.json()["agent"])


async def test_apply_list_show_and_delete(mesh: Mesh, tmp_path: Path) -> None:
    path = tmp_path / "agents.yaml"
    path.write_text(FILE)
    first = await agents(mesh, "apply", "-f", str(path))
    assert (first.code, first.out, first.err) == (0, "agent/reviewer created\nagent/planner created\n", "")
    reviewer = await get(mesh, "reviewer")
    assert (reviewer["version"], reviewer["owner"], reviewer["invoke"]["maxParallel"]) == (1, mesh.user, 2)
    assert reviewer["invoke"]["timeoutMs"] == 60_000, "what the file leaves out has its default"

    # Applying the same file again changes nothing.
    again = await agents(mesh, "apply", "-f", str(path))
    assert (again.code, again.out) == (0, "agent/reviewer unchanged\nagent/planner unchanged\n")
    assert (await get(mesh, "reviewer"))["version"] == 1

    # An edit of the file: the changed agent is configured; a field the file no longer gives goes back
    # to its default (the file is the agent).
    edited = FILE.replace("Review the code you are given.", "Review strictly.").replace(
        "    description: Splits work.\n", ""
    )
    path.write_text(edited)
    changed = await agents(mesh, "apply", "-f", str(path))
    assert (changed.code, changed.out) == (0, "agent/reviewer configured\nagent/planner configured\n")
    reviewer = await get(mesh, "reviewer")
    planner = await get(mesh, "planner")
    assert (reviewer["version"], reviewer["systemPrompt"]) == (2, "Review strictly.")
    assert (planner["version"], planner["description"]) == (2, "")
    assert planner["subagentConfig"]["allowedPresetAgentIds"] == ["reviewer"]
    # The next turn with it uses what was applied.
    start = len(mesh.mock.requests())
    events = await chat(mesh, "reviewer", "look at this")
    assert events[-1]["type"] == "done"
    assert system_of(mesh.mock.requests()[start]) == "Review strictly."

    listed = await agents(mesh, "list")
    assert listed.code == 0
    lines = listed.out.splitlines()
    assert lines[0].split() == ["SLUG", "NAME", "OWNER", "VERSION", "TOOLS"]
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line) for line in lines[1:])}
    assert rows["reviewer"] == ["reviewer", "Reviewer", mesh.user, "2", "agent-invoke"]
    assert rows["general"][2] == "built-in"
    as_json = json.loads((await agents(mesh, "list", "-o", "json")).out)
    assert {a["slug"] for a in as_json} >= {"reviewer", "planner", "general"}

    shown = await agents(mesh, "show", "reviewer")
    assert shown.code == 0 and yaml.safe_load(shown.out) == reviewer
    assert json.loads((await agents(mesh, "show", "reviewer", "-o", "json")).out) == reviewer

    deleted = await agents(mesh, "delete", "planner")
    assert (deleted.code, deleted.out) == (0, "agent/planner deleted\n")
    missing = await agents(mesh, "show", "planner")
    assert (missing.code, missing.err) == (
        1,
        "agentmesh agents show: agent/planner: unknown agent 'planner'\n",
    )
    gone = await agents(mesh, "delete", "planner")
    assert (gone.code, gone.err) == (
        1,
        "agentmesh agents delete: agent/planner: error 404: unknown agent 'planner'\n",
    )


async def test_apply_refuses_what_the_gateway_refuses(mesh: Mesh, tmp_path: Path) -> None:
    path = tmp_path / "agents.yaml"
    path.write_text(FILE)
    assert (await agents(mesh, "apply", "-f", str(path))).code == 0

    # A stale file (it names the version it was written against) is refused, and changes nothing.
    stale = yaml.safe_load(FILE)["agents"][0] | {"version": 1, "systemPrompt": "Mine."}
    other = await agents(mesh, "apply", "-f", "-", stdin=yaml.safe_dump({**stale, "systemPrompt": "Theirs."}))
    assert (other.code, other.out) == (0, "agent/reviewer configured\n")
    late = await agents(mesh, "apply", "-f", "-", stdin=yaml.safe_dump(stale))
    assert late.code == 1 and late.out == ""
    assert late.err == (
        "agentmesh agents apply: agent/reviewer: error 412: agent 'reviewer' is at version 2, not 1: "
        "read it again and redo the change\n"
    )
    assert (await get(mesh, "reviewer"))["systemPrompt"] == "Theirs."

    # Several documents; a bad agent is reported, the others are still applied.
    docs = (
        "slug: ok-one\nname: OK\n---\n"
        "- slug: bad\n  name: Bad\n  tools: [shell]\n- slug: ok-two\n  name: OK 2\n"
    )
    mixed = await agents(mesh, "apply", "-f", "-", stdin=docs)
    assert mixed.code == 1
    assert mixed.out == "agent/ok-one created\nagent/ok-two created\n"
    assert mixed.err.startswith("agentmesh agents apply: agent/bad: error 422: tools: unknown tool 'shell'")

    for text, message in (
        ("", "-: no agents in it"),
        ("- name: no slug\n", "-: agent 1 is not a mapping with a slug"),
        ("a: [", "cannot read -:"),
    ):
        bad = await agents(mesh, "apply", "-f", "-", stdin=text)
        assert bad.code == 1 and bad.err.startswith(f"agentmesh agents apply: {message}"), bad.err
        assert bad.err.count("\n") == 1, bad.err  # one line, also for a YAML error
    wrong_key = await agents(mesh, "list", key="am_wrong")
    assert wrong_key.code == 1 and "error 401" in wrong_key.err
