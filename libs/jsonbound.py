"""One bound for JSON wherever it enters the mesh (docs/http-api.md#json-bounds): HTTP bodies, WebSocket
messages, A2A JSON-RPC requests, and the protobuf Structs the services take over gRPC.

- depth: at most MAX_DEPTH nested objects and arrays (a protobuf Struct holds about 48 levels before
  protobuf's own recursion limit of 100 refuses it, as an internal error);
- numbers: integers of at most MAX_INT_DIGITS digits (below Python's 4,300-digit conversion limit and
  any 64-bit field), and finite ones only: no `NaN`, `Infinity` (not JSON, though Python's parser takes
  them), nor a float that overflows to infinity (`1e400`);
- strings: no U+0000 and no lone surrogate (`"\\ud800"`), in keys and values alike: PostgreSQL stores
  neither in text, and a surrogate is not UTF-8 at all. The gateway refuses them on both databases.

`loads` parses text or bytes under the bound (BoundError, an InvalidArgument, for a breach;
json.JSONDecodeError and UnicodeDecodeError for what is not JSON at all); `check` holds an already
parsed value to it; `check_struct` a protobuf Struct (depth and numbers: a Struct keeps NUL as JSON's
`\\u0000`, which both databases store).
"""

from __future__ import annotations

import json
import math
from typing import Any

from agentmesh.libs.errors import InvalidArgument

MAX_DEPTH = 32
MAX_INT_DIGITS = 20  # 2**64 - 1 has 20


class BoundError(InvalidArgument):
    """A JSON value beyond the bound: too deep, a number too large or not finite, a string PostgreSQL
    refuses."""


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BoundError(f"an integer has more than {MAX_INT_DIGITS} digits")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BoundError(f"the number {text[:40]} is out of range")
    return value


def _constant(name: str) -> Any:
    raise BoundError(f"{name} is not a JSON number")


def loads(data: str | bytes | bytearray, root: str = "") -> Any:
    """`data` parsed and checked (see the module's docstring); `root` names the document in messages
    ("body": `body.messages[0].content: must not contain U+0000`)."""
    try:
        value = json.loads(data, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise BoundError(_at(root, f"nested deeper than {MAX_DEPTH} levels")) from None
    except BoundError as err:
        raise BoundError(_at(root, err.message)) from None
    return check(value, root)


def _at(where: str, what: str) -> str:
    return f"{where[:200]}: {what}" if where else what


def _string(text: str, where: str) -> None:
    if "\x00" in text:
        raise BoundError(_at(where, "must not contain U+0000"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BoundError(_at(where, "holds a lone surrogate (not UTF-8)")) from None


def check(value: Any, root: str = "") -> Any:
    """`value` (what json.loads makes) if it keeps the bound; BoundError naming where it does not."""
    stack: list[tuple[Any, int, str]] = [(value, 0, root)]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, dict | list):
            if depth >= MAX_DEPTH:
                raise BoundError(_at(root, f"nested deeper than {MAX_DEPTH} levels"))
            if len(where) > 200:
                where = where[:200] + "..."
            if isinstance(item, dict):
                for key, sub in item.items():
                    _string(key, f"a key of {where}" if where else "a key")
                    stack.append((sub, depth + 1, f"{where}.{key}" if where else str(key)))
            else:
                stack.extend((sub, depth + 1, f"{where}[{i}]") for i, sub in enumerate(item))
        elif isinstance(item, str):
            _string(item, where)
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if abs(item) >= 10**MAX_INT_DIGITS:
                raise BoundError(_at(where, f"an integer of more than {MAX_INT_DIGITS} digits"))
        elif isinstance(item, float) and not math.isfinite(item):
            raise BoundError(_at(where, "not a finite number"))
    return value


def check_struct(struct: Any, what: str = "metadata") -> None:
    """A protobuf Struct (or Value, or ListValue) within MAX_DEPTH levels and with finite numbers only;
    BoundError naming `what` otherwise."""
    stack: list[tuple[Any, int]] = [(struct, 0)]
    while stack:
        item, depth = stack.pop()
        name = item.DESCRIPTOR.full_name
        if name == "google.protobuf.Value":
            kind = item.WhichOneof("kind")
            if kind == "number_value" and not math.isfinite(item.number_value):
                raise BoundError(f"{what} holds a number that is not finite")
            if kind in ("struct_value", "list_value"):
                stack.append((getattr(item, kind), depth))
            continue
        if depth >= MAX_DEPTH:
            raise BoundError(f"{what} is nested deeper than {MAX_DEPTH} levels")
        values = item.fields.values() if name == "google.protobuf.Struct" else item.values
        stack.extend((sub, depth + 1) for sub in values)
