"""The OpenAI Chat Completions request as the scripted model server checks it: what the API rejects (a
useful subset), answered with the same kind of 400 error."""

from __future__ import annotations

import re
from typing import Any

from starlette.responses import JSONResponse

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def error_response(
    status: int, message: str, type_: str, code: str | None, param: str | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def validate(body: Any) -> None:
    """Reject what the OpenAI API rejects (a useful subset), with the same kind of 400 errors."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("you must provide a model parameter", "model", "missing_required_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array.", "messages", "invalid_value")
    pending: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"Invalid type for '{where}': expected an object.", where, "invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"Invalid value: '{role}'. Supported values are: {ROLES}.", f"{where}.role")
        if pending and role != "tool":
            raise BadRequest(
                "An assistant message with 'tool_calls' must be followed by tool messages responding to "
                "each 'tool_call_id'. The following tool_call_ids did not have response messages: "
                f"{sorted(pending)}",
                f"{where}.role",
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"Invalid type for '{where}.content'.", f"{where}.content", "invalid_type")
        if role == "assistant":
            calls = message.get("tool_calls") or []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if (
                    not isinstance(call.get("id"), str)
                    or call.get("type") != "function"
                    or not isinstance(fn, dict)
                    or not isinstance(fn.get("name"), str)
                    or not isinstance(fn.get("arguments"), str)
                ):
                    raise BadRequest(
                        "A tool call needs id, type 'function' and function {name, arguments (a string)}.",
                        f"{where}.tool_calls[{j}]",
                    )
            if content is None and not calls:
                raise BadRequest(f"Missing content in '{where}'.", f"{where}.content")
            pending = {call["id"] for call in calls}
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise BadRequest(f"Missing 'tool_call_id' in '{where}'.", f"{where}.tool_call_id")
            if call_id not in pending:
                raise BadRequest(
                    "Invalid parameter: messages with role 'tool' must be a response to a preceeding message "
                    "with 'tool_calls'.",
                    f"{where}.role",
                )
            pending.discard(call_id)
        elif content is None:
            raise BadRequest(f"Missing content in '{where}'.", f"{where}.content")
    if pending:
        raise BadRequest(
            f"The tool calls {sorted(pending)} of the last assistant message have no tool messages.",
            "messages",
        )
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("'stream' must be a boolean.", "stream", "invalid_type")
    if body.get("stream_options") is not None and not body.get("stream"):
        raise BadRequest(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options"
        )
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise BadRequest(f"'{key}' must be a positive integer.", key, "invalid_value")
    if body.get("n", 1) != 1:
        raise BadRequest("This server returns one choice only (n=1).", "n", "unsupported_value")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be an array.", "tools", "invalid_type")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if tool.get("type") != "function" or not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
                raise BadRequest(
                    f"Invalid tool: expected type 'function' and a name matching {TOOL_NAME.pattern}.",
                    f"tools[{i}]",
                )
