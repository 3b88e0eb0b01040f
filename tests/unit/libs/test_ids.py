"""libs.ids: the trace reference grammar (local, agent://host[:port]/id, @alias/id) and stream keys,
property-tested: everything we format parses back to itself, and malformed input is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentmesh.libs.errors import InvalidArgument
from agentmesh.libs.ids import (
    MAX_REF,
    TraceRef,
    check_local_id,
    is_local_id,
    new_id,
    new_token_id,
)

ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
local_ids = st.builds(
    lambda head, tail: head + tail,
    st.sampled_from(ALNUM + "_"),
    st.text(alphabet=ALNUM + "_.-", max_size=63),
)
labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
dns_hosts = (
    st.lists(labels, min_size=1, max_size=4).map(".".join).filter(lambda h: not h.replace(".", "").isdigit())
)
ipv4_hosts = st.ip_addresses(v=4).map(str)
ipv6_hosts = st.ip_addresses(v=6).map(lambda a: f"[{a.compressed}]")
hosts = st.one_of(dns_hosts, ipv4_hosts, ipv6_hosts)
aliases = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,30}", fullmatch=True)
refs = st.one_of(
    st.builds(TraceRef, local_ids),
    st.builds(lambda i, h, p: TraceRef(i, host=h, port=p), local_ids, hosts, st.integers(0, 65535)),
    st.builds(lambda i, a: TraceRef(i, alias=a), local_ids, aliases),
)


@given(refs)
def test_every_reference_round_trips(ref: TraceRef) -> None:
    text = str(ref)
    assert TraceRef.parse(text) == ref
    assert str(TraceRef.parse(text)) == text
    assert ref.is_local == (text == ref.id)


@given(local_ids)
def test_a_local_id_is_its_own_reference(ident: str) -> None:
    assert is_local_id(ident) and TraceRef.parse(ident) == TraceRef(ident)


@given(st.text(max_size=80))
def test_parse_never_raises_anything_but_invalid_argument(text: str) -> None:
    try:
        ref = TraceRef.parse(text)
    except InvalidArgument:
        return
    assert TraceRef.parse(str(ref)) == ref


def test_the_seed_examples() -> None:
    full = TraceRef.parse("agent://terminal-agent-456.local:8000/abc-123")
    assert (full.host, full.port, full.id, full.authority) == (
        "terminal-agent-456.local",
        8000,
        "abc-123",
        "terminal-agent-456.local:8000",
    )
    short = TraceRef.parse("@terminal-agent-456/abc-123")
    assert (short.alias, short.id, short.is_local) == ("terminal-agent-456", "abc-123", False)
    assert TraceRef.parse("abc-123").is_local
    assert TraceRef.parse("agent://Peer.Example/x").host == "peer.example", "hosts are case-insensitive"
    assert TraceRef.parse("agent://[::1]:9/x").authority == "[::1]:9"


@pytest.mark.parametrize(
    "text",
    [
        "",
        " abc",
        "abc def",
        "abc/def",
        ".hidden",
        "-dash",
        "x" * 65,
        "agent://",
        "agent:///abc",
        "agent://host",
        "agent://host/",
        "agent://host/a/b",
        "agent://user@host/abc",
        "agent://user:pw@host:80/abc",
        "agent://host:0/abc",
        "agent://host:65536/abc",
        "agent://host:-1/abc",
        "agent://host:\uff18\uff10/abc",  # full-width digits
        "agent://host:/abc",
        "agent://ho st/abc",
        "agent://-host/abc",
        "agent://host-/abc",
        "agent://256.1.1.1/abc",
        "agent://1.2.3/abc",
        "agent://[::1/abc",
        "agent://[zz::1]/abc",
        "agent://host/abc?x=1",
        "agent://host/abc#frag",
        "AGENT://host/abc",
        "http://host/abc",
        "@/abc",
        "@alias",
        "@alias/",
        "@al/ias/abc",
        "@al ias/abc",
        "@-alias/abc",
        "@alias/a b",
        "agent://" + "a" * 300 + "/x",
        "a" * (MAX_REF + 1),
    ],
)
def test_malformed_references_are_refused(text: str) -> None:
    with pytest.raises(InvalidArgument):
        TraceRef.parse(text)


def test_constructed_references_are_checked() -> None:
    with pytest.raises(InvalidArgument):
        TraceRef("abc", host="h", alias="a")
    with pytest.raises(InvalidArgument):
        TraceRef("abc", port=80)
    with pytest.raises(InvalidArgument):
        TraceRef("abc", host="Upper.Case")  # not canonical: parse lower-cases it
    with pytest.raises(InvalidArgument):
        TraceRef("a/b")


def test_new_ids_are_local_ids_and_do_not_repeat() -> None:
    made = {new_id() for _ in range(200)} | {new_token_id() for _ in range(200)}
    assert len(made) == 400 and all(is_local_id(i) for i in made)
    assert len(new_token_id()) == 24 and check_local_id("ok") == "ok"
