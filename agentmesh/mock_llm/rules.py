"""The rules of the scripted model: parsing a rules document, matching a request, rendering a reply.

A reply's templates see `{user}` (the last user message), `{system}`, the named groups of the rule's
`user` regex, and the results of the tool calls the request answers (the tool messages after the last
assistant message): `{tool_results}` / `{tool_result_N}` as the tools returned them (JSON for the mesh's
tools), and `{tool_text}` / `{tool_text_N}` rendered for reading (`readable`): an agent-invoke callee's
reply as its own markdown, a batch of subagents or callees as a markdown list of short summaries, a
failure as one line, never a JSON dump.
"""

from __future__ import annotations

import asyncio
import json
import re
import string
from dataclasses import dataclass, field
from typing import Any

import yaml

FAULTS = ("http_429", "http_500", "stall", "stall_before", "cut")
FILLER = (
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore et "
    "dolore magna aliqua"
).split()
PIECE = re.compile(r"\S{1,24}\s*|\s+")
_MATCH_KEYS = {"model", "system", "user", "after_tool", "tools_include"}
_REPLY_KEYS = {"text", "tool_calls", "fault", "repeat", "tokens", "ttft_ms", "tokens_per_second"}
_OTHER_KEYS = {"name", "times", "barrier", "barrier_timeout_ms", "require_tools"}
_TOP_KEYS = {"rules", "default", "ttft_ms", "tokens_per_second", "models"}


class RulesError(ValueError):
    """A rules document that cannot be used."""


def pieces(text: str) -> list[str]:
    """Split text into token-like pieces whose concatenation is the text (a word and its trailing space)."""
    return PIECE.findall(text)


def word_count(text: str) -> int:
    return len(text.split())


class _Vars(dict[str, str]):
    """Template variables; an unknown name renders as itself so a typo is visible in the reply."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _check_template(value: str, where: str) -> None:
    try:
        for _, name, _, _ in string.Formatter().parse(value):
            if name is not None and not re.fullmatch(r"\w*", name):
                raise RulesError(f"{where}: only plain {{name}} placeholders are allowed, got {{{name}}}")
    except ValueError as exc:
        raise RulesError(f"{where}: bad template {value!r}: {exc}") from exc


def _check_tree(value: Any, where: str) -> None:
    if isinstance(value, str):
        _check_template(value, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_tree(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_tree(item, f"{where}[{i}]")


def render(value: Any, variables: dict[str, str]) -> Any:
    """Render every string of a (nested) template value with str.format_map."""
    if isinstance(value, str):
        return value.format_map(_Vars(variables))
    if isinstance(value, dict):
        return {key: render(item, variables) for key, item in value.items()}
    if isinstance(value, list):
        return [render(item, variables) for item in value]
    return value


class _Barrier:
    """Holds arrivals until `parties` of them wait at once (or a timeout passes)."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.waiting = 0
        self.event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        event = self.event
        self.waiting += 1
        if self.waiting >= self.parties:
            event.set()
            self.event = asyncio.Event()
            self.waiting = 0
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            if self.event is event:
                self.waiting -= 1


@dataclass
class ToolCallSpec:
    name: str
    arguments: Any


@dataclass
class Rule:
    """One scripted behaviour: optional match conditions and the reply."""

    name: str
    model: re.Pattern[str] | None = None
    system: re.Pattern[str] | None = None
    user: re.Pattern[str] | None = None
    after_tool: bool | None = None
    tools_include: list[str] = field(default_factory=list)
    text: str | None = None
    tool_calls: list[ToolCallSpec] = field(default_factory=list)
    fault: str | None = None
    repeat: int = 1
    tokens: int | None = None
    ttft_ms: float | None = None
    tokens_per_second: float | None = None
    times: int | None = None
    require_tools: bool = True
    barrier: _Barrier | None = None
    barrier_timeout_ms: float = 10_000
    uses: int = 0

    def match(self, request: ChatRequestView) -> dict[str, str] | None:
        """The user regex's named groups when this rule applies to the request, else None."""
        if self.times is not None and self.uses >= self.times:
            return None
        if self.model is not None and not self.model.fullmatch(request.model):
            return None
        if self.system is not None and not self.system.search(request.system):
            return None
        if self.after_tool is not None and self.after_tool != request.after_tool:
            return None
        needed = set(self.tools_include)
        if self.require_tools:
            needed |= {call.name for call in self.tool_calls}
        if self.tool_calls and self.require_tools and request.tool_choice == "none":
            return None
        if not needed <= request.tool_names:
            return None
        groups: dict[str, str] = {}
        if self.user is not None:
            found = self.user.search(request.user)
            if found is None:
                return None
            groups = {key: value or "" for key, value in found.groupdict().items()}
        return groups


@dataclass
class RuleSet:
    """An ordered list of rules (first match wins), a default reply and the global timing."""

    rules: list[Rule]
    default: Rule
    ttft_ms: float | None = None
    tokens_per_second: float | None = None
    models: list[str] = field(default_factory=lambda: ["mock-gpt"])

    def select(self, request: ChatRequestView) -> tuple[Rule, dict[str, str]]:
        for rule in self.rules:
            groups = rule.match(request)
            if groups is not None:
                rule.uses += 1
                return rule, groups
        self.default.uses += 1
        return self.default, {}


@dataclass
class ChatRequestView:
    """What the rules look at in a chat completion request."""

    model: str
    system: str
    user: str
    after_tool: bool
    tool_results: list[str]
    tool_names: set[str]
    tool_choice: Any

    @classmethod
    def of(cls, body: dict[str, Any]) -> ChatRequestView:
        messages: list[dict[str, Any]] = body["messages"]
        # The first system message, the agent's prompt: a later one (a background subagent's note,
        # docs/agents.md#background-subagents) names other agents, which must not match their rules.
        system = next(
            (content_text(m.get("content")) for m in messages if m["role"] in ("system", "developer")), ""
        )
        users = [content_text(m.get("content")) for m in messages if m["role"] == "user"]
        results: list[str] = []
        for message in reversed(messages):
            if message["role"] != "tool":
                break
            results.insert(0, content_text(message.get("content")))
        names = {t["function"]["name"] for t in body.get("tools") or [] if t.get("type") == "function"}
        return cls(
            model=body["model"],
            system=system,
            user=users[-1] if users else "",
            after_tool=messages[-1]["role"] == "tool",
            tool_results=results,
            tool_names=names,
            tool_choice=body.get("tool_choice"),
        )

    def variables(self, groups: dict[str, str]) -> dict[str, str]:
        texts = [readable(result) for result in self.tool_results]
        variables = {
            "user": self.user,
            "system": self.system,
            "tool_results": "\n".join(self.tool_results),
            "tool_text": "\n\n".join(texts),
            "title": short_title(self.user),
        }
        variables.update({f"tool_result_{i}": text for i, text in enumerate(self.tool_results, start=1)})
        variables.update({f"tool_text_{i}": text for i, text in enumerate(texts, start=1)})
        variables.update(groups)
        return variables


# Words a chat's title can do without ("please ask the coding assistant to write fizzbuzz").
_TITLE_FILLER = frozenset(
    "a an the please can could would will you me my i we us to for of and or in on with about hi hello "
    "ask tell help want need let lets let's just some".split()
)


def short_title(text: str, words: int = 6) -> str:
    """A few words that say what a message is about: its first line, without filler words, at most
    `words` of them, capitalised ("Coding assistant write fizzbuzz"); the `{title}` of a rule."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    found = re.findall(r"[\w][\w'.+#-]*", line)
    kept = [w for w in found if w.lower() not in _TITLE_FILLER]
    if len(kept) < 2:  # a greeting or a one-word question: its own words say it best
        kept = found
    title = " ".join(kept[:words]).rstrip(".")
    return title[:1].upper() + title[1:]


BRIEF_CHARS = 160  # the longest summary of one item in a readable list


def brief(text: str) -> str:
    """The first paragraph of a reply on one line (up to a blank line or a code fence), at most
    BRIEF_CHARS long, without a trailing colon: a list item's summary."""
    lines: list[str] = []
    for line in text.strip().splitlines():
        if not line.strip() or line.lstrip().startswith("```"):
            if lines:
                break
            continue
        lines.append(line.strip())
    out = " ".join(" ".join(lines).split()).rstrip(":").rstrip()
    if len(out) > BRIEF_CHARS:
        out = out[: BRIEF_CHARS - 1].rsplit(" ", 1)[0].rstrip(",;:") + "…"
    return out


def _failure(result: dict[str, Any]) -> str:
    return f"failed: {result.get('error') or result.get('code') or 'no reason given'}"


def _item(result: Any) -> str:
    """One entry of a batch (a subagent, one call of a list agent-invoke) as a markdown list item."""
    if not isinstance(result, dict):
        return f"- {brief(readable_value(result))}"
    name = result.get("name") or result.get("agent") or result.get("goal") or ""
    status = str(result.get("status") or "")
    if status in ("failed", "cancelled") or result.get("ok") is False or "error" in result:
        body = _failure(result) if status != "cancelled" else "cancelled"
    elif status in ("queued", "running"):  # a background subagent under way, with its text so far
        latest = brief(str(result.get("latest") or ""))
        body = f"{status}: {latest}" if latest else status
    elif not status and result.get("traceId") and result.get("goal"):  # a background subagent's handle
        body = f"started ({result.get('id')}): {result['goal']}"
    else:
        body = brief(str(result.get("summary") or result.get("output") or result.get("content") or ""))
    return f"- **{name}**: {body}" if name else f"- {body}"


def readable_value(value: Any) -> str:
    """A tool's output (parsed) for reading: see `readable`."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_item(item) for item in value)
    if isinstance(value, dict):
        for key in ("results", "subagents", "handles"):  # a batch, background subagents, their handles
            if isinstance(value.get(key), list):
                return "\n".join(_item(item) for item in value[key])
        if value.get("ok") is False and "output" not in value:
            return _failure(value)
        for key in ("output", "summary", "content", "text"):  # an agent-invoke callee's reply, ...
            if isinstance(value.get(key), str):
                return value[key] if value.get("ok") is not False else _failure(value)
        return "\n".join(f"- **{key}**: {_inline(item)}" for key, item in value.items())
    return "" if value is None else str(value)


def _inline(value: Any) -> str:
    """A value of some other tool's result on one line: a list of plain values joined with commas."""
    if isinstance(value, list) and not any(isinstance(item, dict | list) for item in value):
        return ", ".join(str(item) for item in value)
    return brief(readable_value(value))


def readable(result: str) -> str:
    """A tool message rendered for reading, never a JSON dump: a JSON result's text (an agent-invoke
    reply as the callee wrote it, markdown and all), a batch's entries as a markdown list of short
    summaries (`- **Coding Assistant**: ...`), a failure as `failed: <why>`; any other text as it is."""
    try:
        value = json.loads(result)
    except ValueError:
        return result
    return readable_value(value)


def content_text(content: Any) -> str:
    """The text of a message content: a string or a list of parts (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


@dataclass
class Reply:
    """A rendered reply: text and tool calls (arguments as JSON strings)."""

    text: str
    tool_calls: list[tuple[str, str]]


def build_reply(rule: Rule, variables: dict[str, str]) -> Reply:
    """Render a rule's reply for one request."""
    text = render(rule.text, variables) if rule.text is not None else ""
    if rule.repeat > 1 and text:
        sep = "" if text[-1].isspace() else " "
        text = sep.join([text] * rule.repeat)
    if rule.tokens is not None:
        words = text.split() or FILLER
        text = " ".join(words[i % len(words)] for i in range(rule.tokens))
    calls = [(call.name, json.dumps(render(call.arguments, variables))) for call in rule.tool_calls]
    return Reply(text=text, tool_calls=calls)


def _regex(value: Any, where: str) -> re.Pattern[str]:
    if not isinstance(value, str):
        raise RulesError(f"{where} must be a string (a regular expression)")
    try:
        return re.compile(value, re.DOTALL)
    except re.error as exc:
        raise RulesError(f"{where}: bad regular expression {value!r}: {exc}") from exc


def _number(raw: dict[str, Any], key: str, where: str, *, integer: bool = False) -> Any:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise RulesError(f"{where}.{key} must be a non-negative number")
    if integer and not isinstance(value, int):
        raise RulesError(f"{where}.{key} must be an integer")
    return value


def parse_rule(raw: Any, where: str) -> Rule:
    """Parse one rule mapping."""
    if not isinstance(raw, dict):
        raise RulesError(f"{where} must be a mapping")
    unknown = set(raw) - _MATCH_KEYS - _REPLY_KEYS - _OTHER_KEYS
    if unknown:
        raise RulesError(f"{where}: unknown keys {sorted(unknown)}")
    rule = Rule(name=str(raw.get("name", where)))
    if "model" in raw:
        rule.model = _regex(raw["model"], f"{where}.model")
    if "system" in raw:
        rule.system = _regex(raw["system"], f"{where}.system")
    if "user" in raw:
        rule.user = _regex(raw["user"], f"{where}.user")
    if "after_tool" in raw:
        if not isinstance(raw["after_tool"], bool):
            raise RulesError(f"{where}.after_tool must be true or false")
        rule.after_tool = raw["after_tool"]
    tools = raw.get("tools_include", [])
    rule.tools_include = [tools] if isinstance(tools, str) else list(tools)
    if "text" in raw:
        rule.text = str(raw["text"])
        _check_template(rule.text, f"{where}.text")
    for i, call in enumerate(raw.get("tool_calls") or []):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise RulesError(f"{where}.tool_calls[{i}] needs a name")
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            raise RulesError(f"{where}.tool_calls[{i}].arguments must be a mapping")
        _check_tree(arguments, f"{where}.tool_calls[{i}].arguments")
        rule.tool_calls.append(ToolCallSpec(name=call["name"], arguments=arguments))
    if "fault" in raw:
        if raw["fault"] not in FAULTS:
            raise RulesError(f"{where}.fault must be one of {list(FAULTS)}")
        rule.fault = raw["fault"]
    if rule.text is None and not rule.tool_calls and rule.fault is None and "tokens" not in raw:
        raise RulesError(f"{where} needs a reply: text, tool_calls, tokens or fault")
    rule.repeat = _number(raw, "repeat", where, integer=True) or 1
    rule.tokens = _number(raw, "tokens", where, integer=True)
    rule.ttft_ms = _number(raw, "ttft_ms", where)
    rule.tokens_per_second = _number(raw, "tokens_per_second", where)
    rule.times = _number(raw, "times", where, integer=True)
    rule.require_tools = bool(raw.get("require_tools", True))
    if raw.get("barrier"):
        rule.barrier = _Barrier(_number(raw, "barrier", where, integer=True))
    rule.barrier_timeout_ms = _number(raw, "barrier_timeout_ms", where) or rule.barrier_timeout_ms
    return rule


def parse_rules(source: str | bytes | dict[str, Any] | list[Any]) -> RuleSet:
    """Parse a rules document: YAML/JSON text, a mapping with `rules`, or a bare list of rules."""
    doc: Any = source
    if isinstance(source, str | bytes):
        try:
            doc = yaml.safe_load(source)
        except yaml.YAMLError as exc:
            raise RulesError(f"not valid YAML: {exc}") from exc
    if doc is None:
        doc = {}
    if isinstance(doc, list):
        doc = {"rules": doc}
    if not isinstance(doc, dict):
        raise RulesError("a rules document is a mapping with `rules` or a list of rules")
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        raise RulesError(f"unknown top-level keys {sorted(unknown)}")
    raw_rules = doc.get("rules") or []
    if not isinstance(raw_rules, list):
        raise RulesError("rules must be a list")
    rules = [parse_rule(raw, f"rules[{i}]") for i, raw in enumerate(raw_rules)]
    default = parse_rule(doc.get("default") or {"text": "You said: {user}"}, "default")
    if default.model or default.system or default.user or default.after_tool is not None or default.times:
        raise RulesError("default takes a reply only, no match conditions")
    models = doc.get("models") or ["mock-gpt"]
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise RulesError("models must be a list of names")
    return RuleSet(
        rules=rules,
        default=default,
        ttft_ms=_number(doc, "ttft_ms", "document"),
        tokens_per_second=_number(doc, "tokens_per_second", "document"),
        models=models,
    )
