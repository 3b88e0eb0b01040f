"""Protobuf messages as the browser-facing JSON: lowerCamelCase keys, int64 as numbers, every field
with its default when unset except proto3 `optional` ones (absent when unset: their presence matters),
enums as short lowercase names (SUBAGENT_STATUS_QUEUED -> "queued", TASK_STATE_INPUT_REQUIRED ->
"input-required"; error codes keep `_`: ERROR_CODE_MODEL_ERROR -> "model_error"), Struct/Value as
plain JSON, timestamps as RFC 3339 strings. One serialiser for every message shape."""

from __future__ import annotations

import re
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message

_WKT_JSON = {
    "google.protobuf.Struct",
    "google.protobuf.Value",
    "google.protobuf.ListValue",
    "google.protobuf.Timestamp",
    "google.protobuf.Duration",
    "google.protobuf.FieldMask",
}
_enum_prefix_cache: dict[str, str] = {}
_SNAKE_ENUMS = {"agentmesh.events.v1.ErrorCode"}  # codes callers compare as identifiers


def _enum_prefix(enum: EnumDescriptor) -> str:
    if enum.full_name not in _enum_prefix_cache:
        _enum_prefix_cache[enum.full_name] = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
    return _enum_prefix_cache[enum.full_name]


def enum_to_str(enum: EnumDescriptor, number: int) -> str:
    value = enum.values_by_number.get(number)
    if value is None or number == 0:
        return ""
    name = value.name.removeprefix(_enum_prefix(enum)).lower()
    return name if enum.full_name in _SNAKE_ENUMS else name.replace("_", "-")


def str_to_enum(enum: EnumDescriptor, text: str) -> int:
    """The inverse of enum_to_str; raises KeyError for an unknown name."""
    name = _enum_prefix(enum) + text.upper().replace("-", "_")
    value = enum.values_by_name.get(name)
    if value is None or value.number == 0:
        raise KeyError(text)
    return value.number


def _optional(field: FieldDescriptor) -> bool:
    """A proto3 `optional` scalar: the one field of its synthetic oneof (`_<name>`)."""
    oneof = field.containing_oneof
    return oneof is not None and oneof.name == f"_{field.name}" and len(oneof.fields) == 1


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return to_json(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return enum_to_str(field.enum_type, value)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return value.hex()
    return value


def _ints(data: Any) -> Any:
    """Struct numbers are doubles; give whole ones back as ints."""
    if isinstance(data, float) and data.is_integer() and abs(data) < 2**53:
        return int(data)
    if isinstance(data, dict):
        return {k: _ints(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_ints(v) for v in data]
    return data


def to_json(msg: Message) -> Any:
    """Every field of `msg`, unset ones with their defaults (messages omitted when unset)."""
    desc: Descriptor = msg.DESCRIPTOR
    if desc.full_name in _WKT_JSON:
        return _ints(json_format.MessageToDict(msg))
    if desc.GetOptions().map_entry:  # pragma: no cover - maps handled below
        raise TypeError("map entry")
    out: dict[str, Any] = {}
    for field in desc.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            vfield = field.message_type.fields_by_name["value"]
            out[field.json_name] = {k: _value(vfield, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.json_name] = [_value(field, v) for v in value]
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if msg.HasField(field.name):
                out[field.json_name] = to_json(value)
        elif _optional(field) and not msg.HasField(field.name):
            continue  # a proto3 `optional` field that is not set stays absent (its presence matters)
        else:
            out[field.json_name] = _value(field, value)
    return out


def from_json(data: Any, msg: Message) -> Message:
    """The inverse of to_json: fills `msg` from its JSON shape (unknown keys are ignored, so a newer
    peer's extra fields do not break an older reader); ValueError for a value of the wrong type."""
    if not isinstance(data, dict):
        raise ValueError(f"{msg.DESCRIPTOR.name}: expected an object")
    desc: Descriptor = msg.DESCRIPTOR
    if desc.full_name in _WKT_JSON:
        json_format.ParseDict(data, msg)
        return msg
    for key, value in data.items():
        field = desc.fields_by_camelcase_name.get(key)
        if field is None or value is None:
            continue
        if field.is_repeated:
            if not isinstance(value, list):
                raise ValueError(f"{key}: expected a list")
            target = getattr(msg, field.name)
            for item in value:
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    from_json(item, target.add())
                else:
                    target.append(_scalar_from_json(field, item))
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            sub = getattr(msg, field.name)
            if field.message_type.full_name in _WKT_JSON:
                json_format.ParseDict(value, sub)
            else:
                from_json(value, sub)
        else:
            setattr(msg, field.name, _scalar_from_json(field, value))
    return msg


def _scalar_from_json(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_ENUM:
        if value == "":
            return 0
        try:
            return str_to_enum(field.enum_type, str(value))
        except KeyError as exc:
            raise ValueError(f"{field.json_name}: unknown value {value!r}") from exc
    if field.type == FieldDescriptor.TYPE_BYTES:
        return bytes.fromhex(value)
    return value


def given_paths(data: dict[str, Any], desc: Descriptor) -> list[str]:
    """The field-mask paths (snake_case) of the fields a JSON object gives, for a JSON merge patch:
    the keys of a nested message become paths of their own (`{"limits": {"maxSteps": 3}}` ->
    `limits.max_steps`; `{}` gives nothing), while well-known types (Struct, ListValue, ...), lists,
    scalars and nulls are whole values. A key that names no field is kept as it is, for the parser to
    refuse."""
    paths: list[str] = []
    for key, value in data.items():
        field = desc.fields_by_camelcase_name.get(key) or desc.fields_by_name.get(key)
        if field is None:
            paths.append(key)
            continue
        sub = field.message_type
        nested = sub is not None and not field.is_repeated and sub.full_name not in _WKT_JSON
        if nested and isinstance(value, dict):
            paths.extend(f"{field.name}.{p}" for p in given_paths(value, sub))
        else:
            paths.append(field.name)
    return paths


_WKT_SCHEMA: dict[str, dict[str, Any]] = {
    "google.protobuf.Struct": {"type": "object"},
    "google.protobuf.Value": {},
    "google.protobuf.ListValue": {"type": "array"},
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
    "google.protobuf.Duration": {"type": "string", "pattern": "^-?[0-9]+(\\.[0-9]+)?s$"},
    "google.protobuf.FieldMask": {"type": "string"},
}
_SCALAR_SCHEMA = {
    FieldDescriptor.TYPE_DOUBLE: {"type": "number"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "pattern": "^([0-9a-f]{2})*$"},
}


def _field_schema(field: FieldDescriptor, refs: dict[str, str], seen: frozenset[str]) -> dict[str, Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return json_schema(field.message_type, refs, seen)
    if field.type == FieldDescriptor.TYPE_ENUM:
        names = [enum_to_str(field.enum_type, v.number) for v in field.enum_type.values]
        return {"type": "string", "enum": sorted(set(names))}  # "" for unset (and unknown) values
    return dict(_SCALAR_SCHEMA.get(field.type, {"type": "integer"}))


def json_schema(
    desc: Descriptor, refs: dict[str, str] | None = None, seen: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """The JSON Schema of what `to_json` makes of a message of type `desc`: every field, present with
    its default when unset, but for message fields (absent when unset); nothing else. `refs` maps full
    message names to `$ref` targets used instead of inline schemas (for named OpenAPI components)."""
    refs = refs or {}
    if desc.full_name in refs and seen:  # nested: refer to the component
        return {"$ref": refs[desc.full_name]}
    if desc.full_name in _WKT_SCHEMA:
        return dict(_WKT_SCHEMA[desc.full_name])
    if desc.full_name in seen:  # pragma: no cover - a recursive message without a component
        return {"type": "object"}
    seen = seen | {desc.full_name}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for field in desc.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value = field.message_type.fields_by_name["value"]
            properties[field.json_name] = {
                "type": "object",
                "additionalProperties": _field_schema(value, refs, seen),
            }
        elif field.is_repeated:
            properties[field.json_name] = {"type": "array", "items": _field_schema(field, refs, seen)}
        else:
            properties[field.json_name] = _field_schema(field, refs, seen)
            if field.type == FieldDescriptor.TYPE_MESSAGE or _optional(field):
                continue  # absent when unset
        required.append(field.json_name)
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_INT_RANGES = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}


def _input_field_schema(field: FieldDescriptor, seen: frozenset[str]) -> dict[str, Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return json_input_schema(field.message_type, seen)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return {"type": "string", "enum": [v.name for v in field.enum_type.values]}
    if field.cpp_type in _INT_RANGES:  # ParseDict takes a number or a string of digits
        low, high = _INT_RANGES[field.cpp_type]
        number = {"type": "integer", "minimum": low, "maximum": high}
        return {"anyOf": [number, {"type": "string", "pattern": "^-?[0-9]+$"}]}
    if field.type == FieldDescriptor.TYPE_BYTES:
        return {"type": "string", "contentEncoding": "base64"}
    return dict(_SCALAR_SCHEMA[field.type])


def json_input_schema(desc: Descriptor, seen: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The JSON Schema of what json_format.ParseDict takes for a message of type `desc`, in its canonical
    form (lowerCamelCase keys): every field optional, `null` for its default, no other key."""
    if desc.full_name in _WKT_SCHEMA:
        return dict(_WKT_SCHEMA[desc.full_name])
    if desc.full_name in seen:  # pragma: no cover - recursive messages
        return {"type": "object"}
    seen = seen | {desc.full_name}
    properties: dict[str, Any] = {}
    for field in desc.fields:
        one = _input_field_schema(field, seen)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value = field.message_type.fields_by_name["value"]
            one = {"type": "object", "additionalProperties": _input_field_schema(value, seen)}
        elif field.is_repeated:
            one = {"type": "array", "items": one}
        properties[field.json_name] = {"anyOf": [one, {"type": "null"}]}
    return {"type": "object", "properties": properties, "additionalProperties": False}
