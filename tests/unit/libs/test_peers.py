"""libs.peers: the registry file's two shapes, what it refuses, and resolution of trace references to
registered peers only (no DNS, no guessing; anything else refused before any connection)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentmesh.libs.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from agentmesh.libs.ids import TraceRef
from agentmesh.libs.peers import PeerConfigError, PeerRegistry

REGISTRY = PeerRegistry.parse(
    {
        "peers": {
            "terminal-agent-456": {
                "url": "https://terminal-agent-456.local:8000",
                "credential": "T_KEY",
                "type": "terminal",
            },
            "cloud": {"url": "http://10.0.0.5", "type": "cloud"},
        },
        "trace_store": {
            "internal": {"type": "database", "url": "postgresql://org-db/traces"},
            "external": {
                "type": "remote",
                "agents": [
                    {
                        "alias": "partner",
                        "url": "https://Partner.Example",
                        "credential": "P_KEY",
                        "type": "org",
                    }
                ],
            },
        },
    }
)


def test_both_shapes_and_the_internal_store() -> None:
    assert sorted(p.alias for p in REGISTRY) == ["cloud", "partner", "terminal-agent-456"]
    assert REGISTRY.store.internal_url == "postgresql://org-db/traces"
    partner = REGISTRY.get("partner")
    assert partner is not None and partner.url == "https://partner.example" and partner.port == 443
    seed = PeerRegistry.parse(
        {"agents": {"t": {"url": "http://t:1", "credential_env": "K", "type": "terminal"}}}
    )
    assert [p.as_json() for p in seed] == [
        {"alias": "t", "url": "http://t:1", "credential": "K", "type": "terminal"}
    ]


def test_resolution_of_every_form() -> None:
    t = REGISTRY.resolve("@terminal-agent-456/abc-123")
    assert t.alias == "terminal-agent-456"
    assert REGISTRY.resolve("agent://terminal-agent-456.local:8000/abc-123") is t
    assert REGISTRY.resolve("agent://partner.example/x").alias == "partner"  # https default port
    assert REGISTRY.resolve("agent://partner.example:443/x").alias == "partner"
    assert REGISTRY.resolve("agent://10.0.0.5:80/x").alias == "cloud"
    assert REGISTRY.canonical(TraceRef.parse("agent://10.0.0.5/x")) == TraceRef("x", alias="cloud")


@pytest.mark.parametrize(
    "ref",
    [
        "@nobody/x",
        "agent://terminal-agent-456.local/abc",  # the registered port is 8000
        "agent://terminal-agent-456.local:8001/abc",
        "agent://169.254.169.254/x",
        "agent://127.0.0.1:22/x",
        "agent://10.0.0.5:8080/x",
        "agent://partner.example.evil.com/x",
        "agent://[::1]/x",
    ],
)
def test_anything_unregistered_is_refused(ref: str) -> None:
    with pytest.raises(PermissionDenied):
        REGISTRY.resolve(ref)


def test_malformed_and_local_refs() -> None:
    for bad in ("agent://user@10.0.0.5/x", "@a/b/c", "@../x"):
        with pytest.raises(InvalidArgument):
            REGISTRY.resolve(bad)
    with pytest.raises(InvalidArgument):
        REGISTRY.resolve("abc")


@given(st.text(max_size=60))
def test_resolve_never_raises_anything_else(text: str) -> None:
    try:
        peer = REGISTRY.resolve(text)
    except (InvalidArgument, PermissionDenied):
        return
    assert peer.alias in {"terminal-agent-456", "cloud", "partner"}


@pytest.mark.parametrize(
    "data",
    [
        {"peers": {"p": {"url": "http://h", "api_key": "am_secret"}}},  # a key never goes in the file
        {"peers": {"p": {"url": "ftp://h"}}},
        {"peers": {"p": {"url": "http://user:pw@h"}}},
        {"peers": {"p": {"url": "http://h/path"}}},
        {"peers": {"p": {"url": "http://h", "type": "mainframe"}}},
        {"peers": {"p": {"url": "http://h", "credential": "not a name"}}},
        {"peers": {"../p": {"url": "http://h"}}},
        {"peers": {"a/b": {"url": "http://h"}}},
        {"peers": {"p": {"url": "http://h"}}, "agents": {"p": {"url": "http://h"}}},
        {"trace_store": {"internal": {"type": "file"}}},
        ["not", "a", "mapping"],
    ],
)
def test_bad_files_are_refused(data: object) -> None:
    with pytest.raises(PeerConfigError):
        PeerRegistry.parse(data)


def test_the_secret_comes_from_the_environment_and_never_shows(tmp_path: Path) -> None:
    path = tmp_path / "peers.yaml"
    path.write_text("peers:\n  t: {url: 'http://t:9', credential: T_KEY}\n")
    peer = PeerRegistry.load(path).get("t")
    assert peer is not None
    assert peer.api_key({"T_KEY": "am_very_secret"}) == "am_very_secret"
    assert "am_very_secret" not in repr(peer) and "am_very_secret" not in str(peer.as_json())
    with pytest.raises(FailedPrecondition, match="T_KEY is not set"):
        peer.api_key({})
    assert len(PeerRegistry.load("")) == 0
    with pytest.raises(PeerConfigError):
        PeerRegistry.load(tmp_path / "missing.yaml")


def test_a_peer_kept_for_some_users_is_unknown_to_the_others() -> None:
    registry = PeerRegistry.parse(
        {"peers": {"home": {"url": "http://h:1", "users": ["alice"]}, "open": {"url": "http://o:1"}}}
    )
    assert registry.resolve("@home/x", "alice").alias == "home"
    assert registry.resolve("@open/x", "bob").alias == "open"
    with pytest.raises(PermissionDenied) as refused:
        registry.resolve("@home/x", "bob")
    with pytest.raises(PermissionDenied) as unknown:
        registry.resolve("@nobody/x", "bob")
    assert str(refused.value).replace("home", "X") == str(unknown.value).replace("nobody", "X")
    with pytest.raises(PermissionDenied, match="not a registered peer"):
        registry.resolve("agent://h:1/x", "bob")
    with pytest.raises(PeerConfigError):
        PeerRegistry.parse({"peers": {"p": {"url": "http://h", "users": "alice"}}})


def test_every_shape_of_the_requirements_loads() -> None:
    flat = PeerRegistry.parse({"trace_store": {"type": "database", "url": "postgresql://org-db/traces"}})
    assert flat.store.internal_url == "postgresql://org-db/traces" and len(flat) == 0
    seed = PeerRegistry.parse(
        {
            "trace_store": {
                "internal": {"type": "database", "url": "postgresql://org-db/traces"},
                "external": {
                    "type": "remote",
                    "agents": [{"url": "https://Partner-Org.example", "credential": "K"}],
                },
            },
            "agents": {
                "terminal-agent-456": {"url": "https://terminal-agent-456.local:8000", "type": "terminal"}
            },
        }
    )
    # an external agent with no alias is named by its URL's host
    assert sorted(p.alias for p in seed) == ["partner-org.example", "terminal-agent-456"]
    assert seed.resolve("@partner-org.example/x").url == "https://partner-org.example"
    assert seed.store.internal_url == "postgresql://org-db/traces"


@pytest.mark.parametrize(
    ("data", "where", "expected"),
    [
        (
            {"peer": {"t": {"url": "http://t"}}},
            "(top level): unknown key 'peer'",
            "agents, peers, trace_store",
        ),
        (
            {"peers": {"t": {"url": "http://t", "typ": "org"}}},
            "peers.t: unknown key 'typ'",
            "credential, type",
        ),
        (
            {"trace_store": {"type": "database", "url": "mongodb://db/traces"}},
            "trace_store.url",
            "postgresql://",
        ),
        (
            {"trace_store": {"internal": {"type": "database", "url": "mongodb://db/traces"}}},
            "trace_store.internal.url",
            "postgresql://",
        ),
        (
            {"trace_store": {"internal": {"url": "postgresql://h/db"}, "intern": {}}},
            "trace_store: unknown",
            "internal",
        ),
        (
            {"trace_store": {"external": {"agents": [{"url": "http://a"}, {"url": "ftp://b"}]}}},
            "trace_store.external.agents[1].url",
            "http:// or https://",
        ),
        (
            {"peers": {"t": {"url": "http://t", "type": "mainframe"}}},
            "peers.t.type",
            "'terminal', 'cloud' or 'org'",
        ),
        ({"peers": {"t": {"type": "org"}}}, "peers.t.url", "required"),
        (
            {"peers": {"t": {"url": "http://t", "api_key": "am_x"}}},
            "peers.t",
            "name its environment variable",
        ),
    ],
)
def test_a_bad_file_says_where_and_what_is_expected(data: object, where: str, expected: str) -> None:
    with pytest.raises(PeerConfigError) as refused:
        PeerRegistry.parse(data, "peers.yaml")
    message = str(refused.value)
    assert message.startswith("peers.yaml: ") and where in message and expected in message, message
    assert "am_x" not in message


def test_an_unset_credential_variable_is_named_with_its_file(tmp_path: Path) -> None:
    path = tmp_path / "peers.yaml"
    path.write_text("peers:\n  t: {url: 'http://t:9', credential: T_KEY}\n  open: {url: 'http://o:9'}\n")
    registry = PeerRegistry.load(path)
    assert registry.require_credentials({"T_KEY": "am_set"}) is registry
    with pytest.raises(PeerConfigError) as refused:
        registry.require_credentials({})
    assert str(refused.value).startswith(str(path)) and "'t': credential" in str(refused.value)
    assert "T_KEY is not set" in str(refused.value) and "'open'" not in str(refused.value)
