"""The mesh's A2A conventions, shared by its A2A server (gateway/a2a) and its A2A client (the
agent-runtime's agent-invoke by URL): what it adds to the wire of A2A v1.0, and how our task states
are A2A's.

- Every event a task streams carries `metadata.offset`, its offset in our buffer `a2a:<task id>`; a
  SubscribeToTask with `Last-Event-ID: <offset>` (an HTTP header, or gRPC metadata `last-event-id`)
  resumes after it, losing and repeating nothing (A2A itself has no resume cursor).
- A message may carry `metadata.traceparent` (W3C trace context; also sent as the `traceparent`
  header) and `metadata.depth` (how deep in agent-invoke calls the caller is), so a trace and the
  recursion limit continue across meshes.
"""

from __future__ import annotations

import math
from typing import Any

from a2a.types import a2a_pb2 as a2a
from google.protobuf import json_format

from agentmesh.libs import jsonbound
from agentmesh.libs.errors import InvalidArgument
from agentmesh.trace.v1 import trace_pb2 as tp

OFFSET_KEY = "offset"
RESUME_HEADER = "last-event-id"
TRACEPARENT_KEY = "traceparent"
DEPTH_KEY = "depth"
USAGE_KEY = "usage"
RESPONSE_ARTIFACT = "response"  # the id of the artifact a task's reply streams into
BEARER_SCHEME = "bearer"  # the name of the security scheme in our agent cards
MAX_DEPTH = 10
# What a `push:<id>` buffer's metadata tells the gateway's push receiver a notification must show
# (docs/a2a.md#push-notifications-of-remote-tasks).
PUSH_TOKEN_SHA256 = "tokenSha256"
PUSH_AUDIENCE = "audience"
PUSH_JWKS_URL = "jwksUrl"


def agent_url(base_url: str, slug: str) -> str:
    """Where agent `slug` of an agentmesh gateway answers A2A (its card below it)."""
    return f"{base_url.rstrip('/')}/a2a/{slug}"


_TO_A2A: dict[int, Any] = {
    tp.TASK_STATE_SUBMITTED: a2a.TASK_STATE_SUBMITTED,
    tp.TASK_STATE_WORKING: a2a.TASK_STATE_WORKING,
    tp.TASK_STATE_INPUT_REQUIRED: a2a.TASK_STATE_INPUT_REQUIRED,
    tp.TASK_STATE_COMPLETED: a2a.TASK_STATE_COMPLETED,
    tp.TASK_STATE_CANCELED: a2a.TASK_STATE_CANCELED,
    tp.TASK_STATE_FAILED: a2a.TASK_STATE_FAILED,
    tp.TASK_STATE_REJECTED: a2a.TASK_STATE_REJECTED,
}
_FROM_A2A: dict[int, Any] = {v: k for k, v in _TO_A2A.items()}
_FROM_A2A[a2a.TASK_STATE_AUTH_REQUIRED] = tp.TASK_STATE_INPUT_REQUIRED
FINAL_A2A_STATES = frozenset(
    {a2a.TASK_STATE_COMPLETED, a2a.TASK_STATE_CANCELED, a2a.TASK_STATE_FAILED, a2a.TASK_STATE_REJECTED}
)


def to_a2a_state(state: int) -> Any:
    """Our TaskState as A2A's (UNSPECIFIED for none)."""
    return _TO_A2A.get(state, a2a.TASK_STATE_UNSPECIFIED)


def from_a2a_state(state: int) -> Any:
    """A2A's TaskState as ours (UNSPECIFIED for none)."""
    return _FROM_A2A.get(state, tp.TASK_STATE_UNSPECIFIED)


def metadata_str(metadata: Any, key: str) -> str:
    """A string value of a protobuf Struct ("" when absent or not a string)."""
    if metadata is None or key not in metadata.fields:
        return ""
    value = metadata.fields[key]
    return value.string_value if value.WhichOneof("kind") == "string_value" else ""


def metadata_depth(metadata: Any) -> int:
    """`metadata.depth` of a message, within 0..MAX_DEPTH (0 when absent or not a number); a number
    that is not finite (NaN, Infinity, 1e400) is InvalidArgument."""
    if metadata is None or DEPTH_KEY not in metadata.fields:
        return 0
    value = metadata.fields[DEPTH_KEY]
    if value.WhichOneof("kind") != "number_value":
        return 0
    if not math.isfinite(value.number_value):
        raise InvalidArgument("metadata.depth must be a finite number")
    return max(0, min(MAX_DEPTH, int(value.number_value)))


def parse_push_notification(body: str) -> a2a.StreamResponse:
    """A push notification's body (a StreamResponse as JSON, or a bare Task) as a StreamResponse;
    ValueError (json_format.ParseError is one) for anything else, and the JSON bound's BoundError
    (an InvalidArgument) for JSON past it (libs/jsonbound.py)."""
    data = jsonbound.loads(body, root="notification")
    if not isinstance(data, dict):
        raise ValueError("a push notification is a JSON object")
    out = a2a.StreamResponse()
    if {"task", "statusUpdate", "artifactUpdate", "message"} & data.keys():
        json_format.ParseDict(data, out, ignore_unknown_fields=True)
    elif "id" in data and "status" in data:  # a Task as such
        json_format.ParseDict(data, out.task, ignore_unknown_fields=True)
    else:
        raise ValueError("a push notification holds a task, a status or an artifact update")
    return out
