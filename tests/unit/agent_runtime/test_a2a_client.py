"""The A2A client's translation of what can go wrong into the one error table, and the URL rules."""

from __future__ import annotations

import httpx
import pytest
from a2a.client.errors import A2AClientError, A2AClientTimeoutError
from a2a.utils.errors import InternalError, InvalidParamsError, TaskNotFoundError

from agentmesh.libs.a2a import agent_url
from agentmesh.libs.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    RemoteFailed,
    Unauthenticated,
    Unavailable,
)
from agentmesh.services.agent_runtime.a2a_client import RemoteAgent, _error
from agentmesh.services.agent_runtime.invoke import _same_url
from agentmesh.services.agent_runtime.remotes import credential


def _status(code: int) -> BaseException:
    request = httpx.Request("POST", "http://x/a2a/y")
    cause = httpx.HTTPStatusError("no", request=request, response=httpx.Response(code, request=request))
    err = A2AClientError(f"HTTP Error {code}")
    err.__cause__ = cause
    return err


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (_status(401), Unauthenticated),
        (_status(403), Unauthenticated),
        (_status(404), NotFound),
        (_status(502), Unavailable),
        (A2AClientTimeoutError("slow"), DeadlineExceeded),
        (TimeoutError(), DeadlineExceeded),
        (A2AClientError("Network communication error: refused"), Unavailable),
        (InvalidParamsError(message="unknown contextId"), InvalidArgument),
        (TaskNotFoundError(), NotFound),
        (InternalError(message="boom"), RemoteFailed),
    ],
)
def test_errors_keep_their_meaning(exc: BaseException, kind: type) -> None:
    assert type(_error(exc, "partner")) is kind


def test_urls() -> None:
    assert agent_url("https://peer.example/", "coder") == "https://peer.example/a2a/coder"
    agent = RemoteAgent("https://peer.example:8443/a2a/coder/.well-known/agent-card.json")
    assert (agent.base, agent.authority) == ("https://peer.example:8443/a2a/coder", "peer.example:8443")
    assert _same_url("https://p.example/a2a/c/", "https://p.example/a2a/c/.well-known/agent-card.json")
    assert not _same_url("https://p.example/a2a/c", "https://p.example/a2a/d")
    assert not _same_url("", "https://p.example/a2a/c")


def test_credential_from_the_environment_or_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PEER_KEY", "k1")
    assert credential("PEER_KEY") == "k1"
    (tmp_path / "key").write_text("k2\n")
    monkeypatch.setenv("OTHER_KEY_FILE", str(tmp_path / "key"))
    assert credential("OTHER_KEY") == "k2"
    assert credential("MISSING_KEY") == "" == credential("")
