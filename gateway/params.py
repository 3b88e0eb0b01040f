"""Parameter types the routes share, with the bounds the OpenAPI document states (and FastAPI checks:
a value outside them is a 422 before any call into the mesh)."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import Path, Query

from agentmesh.libs.ids import LOCAL_ID_PATTERN, MAX_ID, SLUG_PATTERN

ID_PATTERN = f"^{LOCAL_ID_PATTERN}$"
_ID = f"1-{MAX_ID} characters of [A-Za-z0-9_.-], not starting with '.' or '-'"

SessionId = Annotated[
    str, Path(pattern=ID_PATTERN, min_length=1, max_length=MAX_ID, description=f"a session id: {_ID}")
]
SubagentId = Annotated[
    str, Path(pattern=ID_PATTERN, min_length=1, max_length=MAX_ID, description=f"a subagent id: {_ID}")
]
TaskId = Annotated[
    str,
    Query(
        alias="taskId",
        pattern=ID_PATTERN,
        min_length=1,
        max_length=MAX_ID,
        description=f"an agent-invoke task id: {_ID}",
    ),
]
# A trace id of the trace API: a local id, `@alias/<id>` or `agent://<authority>/<id>` (libs/ids.py
# TraceRef). The authority's own grammar (a DNS name, an IPv4 address or a bracketed IPv6 one, a port
# 1-65535) is checked by the parser, with a 422 that says what is wrong: this pattern states the shape.
_ALIAS = "[A-Za-z0-9][A-Za-z0-9_.-]{0,62}"
_AUTHORITY = "[A-Za-z0-9.:\\[\\]-]{1,260}"
TRACE_ID_PATTERN = (
    f"^(?:{LOCAL_ID_PATTERN}|@{_ALIAS}/{LOCAL_ID_PATTERN}|agent://{_AUTHORITY}/{LOCAL_ID_PATTERN})$"
)

# The trace service's page tokens: unpadded base64url of at most 512 characters (services/trace/domain.py
# MAX_PAGE_TOKEN); one it did not issue is a 422.
PageToken = Annotated[
    str,
    Query(
        pattern=r"^[A-Za-z0-9_-]*$",
        max_length=512,
        description="nextPageToken of the previous page; empty for the first",
    ),
]


def digits_at_most(n: int) -> str:
    """A regular expression (ECMA 262 and Python alike) for the decimal strings whose value is at most
    `n`: leading zeros allowed, at most as many digits as `n` has."""
    s = str(n)
    alternatives = [f"[0-9]{{1,{len(s) - 1}}}"] if len(s) > 1 else []
    for i, digit in enumerate(s):  # s[:i], then a smaller digit, then anything
        if digit != "0":
            smaller = "0" if digit == "1" else f"[0-{int(digit) - 1}]"
            rest = len(s) - 1 - i
            alternatives.append(s[:i] + smaller + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(s)
    return "(?:" + "|".join(alternatives) + ")"


U64 = 2**64 - 1
_PART = digits_at_most(U64)
# A stream offset of either backend (memory: up to 20 digits; Redis: `ms-seq`), each part at most 2^64-1,
# or nothing (from the start); blanks around it are ignored.
OFFSET_PATTERN = f"^[ \\t]*(?:{_PART}(?:-{_PART})?)?[ \\t]*$"
_RESUME = "resume after this event id (the `id:` of the last event seen): digits, or two parts joined by "
_BOUND = "-, each at most 18446744073709551615"
# The resume parameters of the SSE routes, for their OpenAPI document (gateway/sse.py resume_offset reads
# and checks them: the header first, else the query parameter).
RESUME_PARAMETERS = {
    "parameters": [
        {
            "name": "Last-Event-ID",
            "in": "header",
            "required": False,
            "description": _RESUME + _BOUND,
            "schema": {"type": "string", "pattern": OFFSET_PATTERN},
        },
        {
            "name": "lastEventId",
            "in": "query",
            "required": False,
            "description": "the same as Last-Event-ID, for clients that cannot set headers",
            "schema": {"type": "string", "pattern": OFFSET_PATTERN},
        },
    ]
}

# Text the gateway takes: no U+0000 (PostgreSQL cannot store it; the gateway answers alike on both
# backends), and for a chat message some character that is not whitespace as Python's str.strip() sees
# it (what the gateway and the orchestrator check), spelt out: JSON Schema's `\s` (ECMA 262) differs.
NO_NUL = r"^[^\x00]*$"
_BLANK = r"\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
MESSAGE_PATTERN = rf"^[^\x00]*[^\x00{_BLANK}][^\x00]*$"

Slug = Annotated[
    str,
    Path(
        pattern=f"^{SLUG_PATTERN}$",
        max_length=100,
        description="an agent's slug: 1-100 characters of [a-z0-9_-], not starting with '_' or '-'",
    ),
]
NEW_SLUG_PATTERN = f"^(?:{SLUG_PATTERN})?$"  # a clone's new slug; empty: one is made up
# If-Match on an agent write: its version as the ETag gives it ("3"; W/"3" and 3 too), or * (any). A
# version is at most 18 digits (an int64 in the service).
IF_MATCH = re.compile(r'(?:\*|(?:W/)?"?0*([1-9][0-9]{0,17})"?)?')
IF_MATCH_PARAMETER = {
    "name": "If-Match",
    "in": "header",
    "required": False,
    "description": 'the version the write was made against, as the ETag gave it ("3"): 412 when the agent '
    "changed since; absent or *: no check",
    "schema": {"type": "string", "pattern": f"^[ \\t]*{IF_MATCH.pattern}[ \\t]*$"},
}
