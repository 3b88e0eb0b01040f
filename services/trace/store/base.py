"""The trace service's storage interfaces, one per resource, and the value types they share.

A store persists; it holds no rule of the domain (masks, status moves, limits, windows, page sizes,
required fields: services/trace/domain.py, applied by the handlers before a store is called). What a
store does check is what only the stored rows can tell, inside the unit of work that writes: every
method takes the acting user (`owner`, from the call's verified identity) first and is scoped to that
user, so another user's row is answered exactly like a missing one (NotFound, same message, same
work); and a row a write refers to must exist (a parent or head sequence, an anchor message, an agent:
InvalidArgument otherwise). A rule that needs the stored row (a status that moves only forward) is
the handler's function, run by the store on the row inside that unit of work.
Arguments and results are the resource messages of agentmesh.trace.v1 / agentmesh.agents.v1.

`TraceStore` and `MessageStore` are what a federation store implements too: the SQL stores here, a
remote store that reads a peer's trace API, a hybrid store that routes by trace reference. What only
some stores can do is a method with a default on the interface (`TraceStore.copy_for_turn`), never a
check of the store's class.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeVar

from agentmesh.agents.v1 import agent_pb2
from agentmesh.libs.errors import MeshError
from agentmesh.services.trace.domain import Cursor
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp


@dataclass
class MessageQuery:
    """Which messages of a trace to list (docs/requirements.md#trace-api)."""

    trace_id: str
    mode: int = ms.PATH_MODE_MAIN_PATH
    head_sequence: int = 0
    since_sequence: int = 0
    limit: int = 0
    offset: int = 0


@dataclass
class MessagePage:
    messages: list[tp.Message]
    head_sequence: int
    total: int
    stale: bool = False  # a peer's trace whose peer did not answer: read from the cached copy
    sync_time: datetime | None = None  # a peer's trace: when its cached copy was last brought up to date


@dataclass
class CopyState:
    """A cached copy of a peer's trace (one per owner and home)."""

    trace_id: str  # the copy's local id
    home: str  # the trace's location-bearing id, @alias/id
    home_sequence: int  # the last of the peer's sequences the copy holds
    synced_at: datetime | None
    outbox: int = 0  # messages appended here, not yet at home (a turn running on the copy)
    outbox_pending: int = 0  # of those, still pending (0 with an outbox: its turn died unsent)
    pending_from: int = 0  # the lowest sequence of a message still pending at home (0: none)


@dataclass(frozen=True)
class TraceCopy:
    """The local copy of a peer's trace that a turn runs on (`TraceStore.copy_for_turn`)."""

    trace_id: str  # the copy's local id
    home: str  # the trace's id at its home, @alias/id


@dataclass
class Deleted:
    """Everything a delete removed, so the caller can drop the live buffers of it too."""

    trace_ids: list[str] = field(default_factory=list)
    task_ids: list[str] = field(default_factory=list)
    subagent_ids: list[str] = field(default_factory=list)


@dataclass
class Append:
    """One append of `append_each`: what append_message takes."""

    owner: str
    message: tp.Message
    parent_sequence: int | None = None


ItemT = TypeVar("ItemT")
PreparedT = TypeVar("PreparedT")
OutcomeT = TypeVar("OutcomeT")


async def each_apart(
    items: Sequence[ItemT],
    prepare: Callable[[ItemT], PreparedT],
    process: Callable[[list[PreparedT]], Awaitable[Sequence[OutcomeT | MeshError]]],
) -> list[OutcomeT | MeshError]:
    """One outcome per item, in order: `prepare` each (a MeshError it raises is that item's outcome),
    then `process` the prepared ones together (one outcome each, in their order)."""
    prepared: list[PreparedT | MeshError] = []
    for item in items:
        try:
            prepared.append(prepare(item))
        except MeshError as err:
            prepared.append(err)
    done = iter(await process([p for p in prepared if not isinstance(p, MeshError)]))
    return [p if isinstance(p, MeshError) else next(done) for p in prepared]


class TraceStore(abc.ABC):
    """Traces: what persists them. The handlers have checked the arguments (docs/design/trace-service.md);
    a store scopes every read and write to `owner` and raises NotFound for a trace the owner does not
    have, missing or not theirs alike."""

    @abc.abstractmethod
    async def create_trace(self, owner: str, trace: tp.Trace, trace_id: str) -> tp.Trace:
        """Stores a new trace of `owner` (the user is created when new) with its agent, kind, title and
        visible_in_sidebar, under `trace_id` (empty: a new random id); AlreadyExists for a taken id."""

    @abc.abstractmethod
    async def get_trace(self, owner: str, trace_id: str) -> tp.Trace:
        """One trace."""

    @abc.abstractmethod
    async def count_messages(self, owner: str, trace_id: str) -> tuple[int, int]:
        """(messages in every branch, messages on the main path)."""

    @abc.abstractmethod
    async def list_traces(self, owner: str, limit: int, after: Cursor | None) -> list[tp.Trace]:
        """At most `limit` of the owner's listed traces (chat ones, and hidden ones that are
        visible_in_sidebar; never a cached copy of a peer's), most recently active first (by update
        time, then id), after `after`."""

    @abc.abstractmethod
    async def update_trace(self, owner: str, trace: tp.Trace, fields: Collection[str]) -> tp.Trace:
        """Sets the `fields` (title, visible_in_sidebar) of trace `trace.id` from `trace`."""

    @abc.abstractmethod
    async def delete_traces(self, owner: str, trace_ids: Sequence[str] | None) -> Deleted:
        """Deletes the traces (None: every trace of the owner) and everything under them: their
        messages, their A2A tasks and the callees' traces, their subagents and the subagents' traces,
        recursively, in one unit of work."""

    @abc.abstractmethod
    async def set_head(self, owner: str, trace_id: str, head_sequence: int) -> tp.Trace:
        """Moves the head to the message of `head_sequence`."""

    async def copy_for_turn(self, owner: str, trace_id: str) -> TraceCopy | None:
        """For a turn on `trace_id` that runs here (agent-invoke continueFrom): the local copy of a
        peer's trace, brought up to date now (the peer must answer); None when the trace is ours. A
        store that holds only this mesh's traces has no copies: None."""
        return None


class MessageStore(abc.ABC):
    """Messages of traces: what persists them, under the same terms as TraceStore's."""

    @abc.abstractmethod
    async def append_message(
        self, owner: str, message: tp.Message, parent_sequence: int | None = None
    ) -> tp.Message:
        """Stores the next message of `message.trace_id` (sequence = last + 1) after the head (or
        parent_sequence; 0: a root) and moves the head to it; InvalidArgument when the trace has no
        message of parent_sequence."""

    async def append_each(self, appends: Sequence[Append]) -> list[tp.Message | MeshError]:
        """Each append as append_message does it, on its own (one that fails fails only itself), in
        the given order: the stored message or the append's error, one per append. This one writes them
        one after another; a store that can writes them together."""
        out: list[tp.Message | MeshError] = []
        for a in appends:
            try:
                out.append(await self.append_message(a.owner, a.message, a.parent_sequence))
            except MeshError as err:
                out.append(err)
        return out

    @abc.abstractmethod
    async def append_messages(
        self,
        owner: str,
        trace_id: str,
        messages: Sequence[tp.Message],
        parent_sequence: int | None = None,
    ) -> list[tp.Message]:
        """Appends `messages` consecutively (the first after the head or parent_sequence, each next
        after the one before), all or none, and moves the head to the last."""

    @abc.abstractmethod
    async def create_trace_with_messages(
        self, owner: str, trace: tp.Trace, trace_id: str, messages: Sequence[tp.Message]
    ) -> tuple[tp.Trace, list[tp.Message]]:
        """A new trace (as TraceStore.create_trace) holding `messages` (as append_messages), all or
        nothing."""

    @abc.abstractmethod
    async def update_message(self, owner: str, message: tp.Message, fields: Collection[str]) -> tp.Message:
        """Sets the `fields` (content, thinking, metadata, model, usage, status) of message `message.id`
        from `message`, and moves its trace's update time."""

    @abc.abstractmethod
    async def get_message(self, owner: str, message_id: int) -> tp.Message:
        """One message."""

    @abc.abstractmethod
    async def list_messages(self, owner: str, query: MessageQuery) -> MessagePage:
        """The main path (or every branch), by sequence, after since_sequence, paged by offset and limit
        (the effective one: never 0); InvalidArgument when head_sequence is not a message of the trace."""


class CopyStore(abc.ABC):
    """Cached copies of peers' traces (federation): trace rows with a `home`, owned by the user who read
    them (invisible to anyone else, deleted with the owner's data), holding the peer's messages under
    the peer's sequences. Messages appended here after home_sequence are the outbox: a turn of a local
    agent running on the copy, sent home when it completes."""

    @abc.abstractmethod
    async def find(self, owner: str, home: str) -> CopyState | None:
        """The owner's copy of `home`, or None."""

    @abc.abstractmethod
    async def of_trace(self, owner: str, trace_id: str) -> CopyState | None:
        """The copy state of a local trace id, or None when it is not a copy."""

    @abc.abstractmethod
    async def homes(self, owned: Collection[tuple[str, str]]) -> dict[tuple[str, str], str]:
        """Of the (owner, trace id) pairs, those naming the owner's copy: pair -> home (one read for
        every owner)."""

    @abc.abstractmethod
    async def save(
        self, owner: str, home: str, trace: tp.Trace, messages: Sequence[tp.Message], final: bool
    ) -> CopyState:
        """Creates or updates the owner's copy of `home`: the trace's fields (agent, kind, title, head)
        and `messages` by sequence (an existing one is replaced: a pending message completed at home).
        `final`: the sync is complete, so synced_at moves."""

    @abc.abstractmethod
    async def outbox(self, owner: str, trace_id: str) -> list[tp.Message]:
        """The messages appended to the copy after home_sequence, by sequence."""

    @abc.abstractmethod
    async def drop_outbox(self, owner: str, trace_id: str) -> None:
        """Removes the outbox (sent home, or given up)."""


@dataclass(frozen=True)
class InboundTaskQuery:
    """Which inbound tasks to list: filters (empty: any)."""

    callee_agent: str = ""
    trace_id: str = ""
    state: int = 0


class TaskStore(abc.ABC):
    """Agent-invoke tasks (docs/requirements.md#invoke-task-rows), under the same terms as TraceStore's."""

    @abc.abstractmethod
    async def create_task(self, owner: str, task: tp.A2ATask, continue_trace_id: str = "") -> tp.A2ATask:
        """A task (in the state given) with the callee's hidden trace: a new one, or `continue_trace_id`
        (its update time moves; it becomes visible_in_sidebar with the task). InvalidArgument for a
        callee that is no agent of the owner's (a peer's agent, @alias/slug, is not looked up)."""

    @abc.abstractmethod
    async def update_task(
        self, owner: str, task_id: str, change: Callable[[tp.A2ATask], tp.A2ATask]
    ) -> tp.A2ATask:
        """In one unit of work: the task as stored, given to `change` (which may raise: nothing is
        written), and its new state stored (with its update time, when it changed)."""

    @abc.abstractmethod
    async def get_task(self, owner: str, task_id: str) -> tp.A2ATask: ...

    @abc.abstractmethod
    async def list_tasks(self, owner: str, caller_trace_id: str) -> list[tp.A2ATask]:
        """The tasks a caller trace started, oldest first."""

    @abc.abstractmethod
    async def list_inbound_tasks(
        self, owner: str, query: InboundTaskQuery, limit: int, after: Cursor | None
    ) -> list[tp.A2ATask]:
        """At most `limit` of the owner's inbound tasks (no trace of the mesh started them: A2A
        clients' calls) that match `query`, newest first (by create time, then id), after `after`."""


@dataclass(frozen=True)
class RunQuery:
    """Which runs to list: filters (0 or empty: any)."""

    state: int = 0  # a RunState
    kind: int = 0  # a RunKind
    agent: str = ""


class RunStore(abc.ABC):
    """Runs (trace.proto Run): the assistant messages of the owner's traces of this mesh (never of a
    cached copy of a peer's), with what started them, under the same terms as TraceStore's."""

    @abc.abstractmethod
    async def list_runs(self, owner: str, query: RunQuery, limit: int, after: Cursor | None) -> list[tp.Run]:
        """At most `limit` of the owner's runs that match `query`, newest first (by start time, then
        message id), after `after` (its id: a message id)."""


# A change of one subagent, given its row as stored and the time of the change: the row as it is to be.
SubagentChange = Callable[[tp.SubagentSession, datetime], tp.SubagentSession]


class SubagentStore(abc.ABC):
    """Subagent rows (docs/requirements.md#subagent-rows), under the same terms as TraceStore's."""

    @abc.abstractmethod
    async def create_subagents(
        self,
        owner: str,
        rows: Sequence[tp.SubagentSession],
        turns: Sequence[tuple[tp.Message, tp.Message]] = (),
    ) -> tuple[list[tp.SubagentSession], list[tuple[tp.Message, tp.Message]]]:
        """The rows of one batch (their source type and status given), each with its hidden trace, in
        one transaction; with `turns` (one per row: a user message and a placeholder), each hidden
        trace begins with its turn's two messages (returned as stored). InvalidArgument when a row's
        anchor is no message of its trace, or it names an agent that is none of the owner's, or none
        runs it (no preset agent, and neither the row nor its trace names one)."""

    @abc.abstractmethod
    async def update_subagents(
        self, owner: str, changes: Sequence[tuple[str, SubagentChange]]
    ) -> list[tp.SubagentSession]:
        """In one transaction, all or none: each (subagent id, change) in order, the row as stored (as
        an earlier change of the same call left it) given to the change, and the row it returns stored
        (status, model, tool_names, summary, result_payload, error, token_usage, start and end times;
        the update time moves). A change may raise: nothing is written."""

    @abc.abstractmethod
    async def get_subagent(self, owner: str, subagent_id: str) -> tp.SubagentSession: ...

    @abc.abstractmethod
    async def list_subagents(
        self, owner: str, trace_id: str, parent_message_id: int = 0
    ) -> list[tp.SubagentSession]:
        """One anchor's rows (0: every anchor of the trace), by anchor and sort order."""


class AgentStore(abc.ABC):
    """Agents: the built-in set and users' own."""

    @abc.abstractmethod
    async def import_builtins(self, agents: Sequence[agent_pb2.Agent]) -> None:
        """Makes the built-in set equal to `agents` (by slug; a changed one gets a new version)."""

    @abc.abstractmethod
    async def get_agent(self, owner: str, slug: str) -> agent_pb2.Agent:
        """The owner's own agent of that slug, else the built-in one; NotFound otherwise."""

    @abc.abstractmethod
    async def list_agents(self, owner: str) -> list[agent_pb2.Agent]:
        """The owner's own agents and the built-in ones (an own agent hides a built-in of its slug)."""

    @abc.abstractmethod
    async def create_agent(self, owner: str, agent: agent_pb2.Agent) -> agent_pb2.Agent:
        """Stores a new agent of the owner at version 1; AlreadyExists when the owner has its slug."""

    @abc.abstractmethod
    async def update_agent(
        self,
        owner: str,
        slug: str,
        change: Callable[[agent_pb2.Agent], agent_pb2.Agent],
        expected_version: int = 0,
    ) -> agent_pb2.Agent:
        """Replaces the owner's own agent by `change(current)` in one unit of work, one version up (none
        when nothing changed). NotFound when the owner has no agent of that slug and there is no
        built-in one, PermissionDenied for a built-in one, VersionMismatch when `expected_version`
        (0: no check) is not the current version."""

    @abc.abstractmethod
    async def delete_agent(self, owner: str, slug: str, expected_version: int = 0) -> None:
        """Deletes the owner's own agent; references to it in messages, tasks and subagent rows are
        cleared. Errors as update_agent's."""


@dataclass
class Reaped:
    """What one round of reaping settled, and the buffers of that work (to be ended)."""

    stream_keys: list[str] = field(default_factory=list)
    messages: int = 0
    tasks: int = 0
    subagents: int = 0


class LeaseStore(abc.ABC):
    """Leases of work in progress (pending placeholders, unfinished tasks and subagents)."""

    @abc.abstractmethod
    async def renew(
        self, message_ids: Sequence[int], task_ids: Sequence[str], subagent_ids: Sequence[str]
    ) -> int:
        """Moves the leases of the rows still in progress forward; returns how many moved."""

    @abc.abstractmethod
    async def reap(self, limit: int) -> Reaped:
        """Settles rows whose lease expired (failed, with the error `interrupted`); at most `limit` of
        each kind per call, never the same row twice across concurrent callers."""


class KeyStore(abc.ABC):
    """Users and their hashed API keys."""

    @abc.abstractmethod
    async def authenticate(self, api_key: str) -> str:
        """The user behind a key; Unauthenticated for an unknown one."""

    @abc.abstractmethod
    async def create_api_key(self, user: str) -> str:
        """A fresh key for `user` (created when new); shown once, only its hash is kept."""
