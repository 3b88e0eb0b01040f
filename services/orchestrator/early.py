"""The early run of a new chat (docs/design/turns.md, "The early run"): its run starts as soon as its
buffer exists, with its agent as this replica last read it for the user, while the rows are stored
and the agent is read again. The agent as read decides: the same, the run is the turn's; changed,
the new chat is dropped (its buffer ended, its trace deleted) and the turn begins again, as a new
chat of its own, with the agent as read.
"""

from __future__ import annotations

from collections import OrderedDict

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.libs.errors import Cancelled
from agentmesh.libs.tools import BUILTIN, SUPERVISOR

# A new chat runs early only while no other turn of the replica begins: under load the early run's
# work would compete with the other turns' set-up and lengthen their tails (bench C).
EARLY_WHILE_BEGINNING = 1


class LastReads:
    """The agent each user's slug was last read as on this replica (at most `size`, the least recently
    used go first): what a new chat's early run starts with (docs/design/turns.md, "The early run")."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._agents: OrderedDict[tuple[str, str], ap.Agent] = OrderedDict()

    def get(self, user: str, slug: str) -> ap.Agent | None:
        agent = self._agents.get((user, slug))
        if agent is not None:
            self._agents.move_to_end((user, slug))
        return agent

    def put(self, user: str, slug: str, agent: ap.Agent) -> None:
        self._agents[(user, slug)] = agent
        self._agents.move_to_end((user, slug))
        while len(self._agents) > self.size:
            self._agents.popitem(last=False)

    def forget(self, user: str, slug: str) -> None:
        self._agents.pop((user, slug), None)


def runs_alone(agent: ap.Agent) -> bool:
    """Whether a supervisor run of `agent` touches nothing but its buffer: an agent of ours with no tool
    (a tool may write rows that name the turn's messages, which an early run has not stored yet)."""
    return not agent.HasField("remote") and not BUILTIN.visible(agent, SUPERVISOR)


class AgentChanged(Cancelled):
    """The agent of an early run changed since it was last read: its new chat was dropped, and the
    turn (re-keyed, with the agent as read) begins again."""


def verdict(last: ap.Agent, read: object, failure: BaseException | None) -> tuple[BaseException | None, str]:
    """Why an early run is not the turn's run (None: it is kept), and the outcome to count: the turn
    did not begin (failed), or its agent reads otherwise than it was last read (AgentChanged: dropped)."""
    if failure is None and read != last:
        failure = AgentChanged(f"agent {last.slug} changed since it was last read")
    outcome = "kept" if failure is None else "dropped" if isinstance(failure, AgentChanged) else "failed"
    return failure, outcome
