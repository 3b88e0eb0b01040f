"""Agents in SQL: the built-in set (owner NULL) and users' own agents (slug unique per owner)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError

from agentmesh.agents.v1 import agent_pb2 as ap
from libs.config import SubagentDefaults
from libs.errors import NotFound
from services.trace import agents as domain
from services.trace.store.base import AgentStore
from services.trace.store.sql.common import Database, now, ts
from services.trace.store.sql.models import AgentRow, User

_IMPORT_ATTEMPTS = 3  # after one replica commits, every catalog slug exists: no insert is left to race


class SqlAgentStore(AgentStore):
    def __init__(self, db: Database, defaults: SubagentDefaults | None = None) -> None:
        self.db = db
        self.defaults = defaults or SubagentDefaults()

    def _pb(self, row: AgentRow, owner: str) -> ap.Agent:
        agent = domain.from_json(row.config, f"stored agent {row.slug}")
        agent.owner = owner
        agent.version = row.version
        agent.create_time.CopyFrom(ts(row.created_at))
        agent.update_time.CopyFrom(ts(row.updated_at))
        agent.effective_subagent_config.CopyFrom(domain.effective_subagent_config(agent, self.defaults))
        return agent

    async def import_builtins(self, agents: Sequence[ap.Agent]) -> None:
        """Upserts every catalog agent by slug (built-ins no longer listed stay: rows reference them).
        Replicas starting together race for the inserts: a loser imports again, over the winners' rows."""
        for attempt in range(1, _IMPORT_ATTEMPTS + 1):
            try:
                return await self._import_builtins(agents)
            except IntegrityError:
                if attempt == _IMPORT_ATTEMPTS:
                    raise

    async def _import_builtins(self, agents: Sequence[ap.Agent]) -> None:
        async with self.db.tx() as db:
            existing = {
                r.slug: r
                for r in (await db.scalars(select(AgentRow).where(AgentRow.owner_user_id.is_(None))))
            }
            stamp = now()
            for agent in agents:
                config = domain.to_json(agent)
                row = existing.get(agent.slug)
                if row is None:
                    db.add(
                        AgentRow(
                            slug=agent.slug,
                            name=agent.name,
                            description=agent.description,
                            model=agent.model,
                            config=config,
                            public=int(agent.public),
                            version=1,
                            created_at=stamp,
                            updated_at=stamp,
                        )
                    )
                elif row.config != config:
                    row.name, row.description, row.model = agent.name, agent.description, agent.model
                    row.config, row.public = config, int(agent.public)
                    row.version += 1
                    row.updated_at = stamp

    async def get_agent(self, owner: str, slug: str) -> ap.Agent:
        async with self.db.read() as db:
            rows = (
                await db.execute(
                    select(AgentRow, User.name)
                    .outerjoin(User, User.id == AgentRow.owner_user_id)
                    .where(
                        AgentRow.slug == slug,
                        or_(AgentRow.owner_user_id.is_(None), User.name == owner),
                    )
                )
            ).all()
        if not rows:
            raise NotFound(f"unknown agent {slug!r}")
        row, name = max(rows, key=lambda r: r[1] is not None)  # one's own agent wins
        return self._pb(row, name or "")

    async def list_agents(self, owner: str) -> list[ap.Agent]:
        async with self.db.read() as db:
            rows = (
                await db.execute(
                    select(AgentRow, User.name)
                    .outerjoin(User, User.id == AgentRow.owner_user_id)
                    .where(or_(AgentRow.owner_user_id.is_(None), User.name == owner))
                    .order_by(AgentRow.slug)
                )
            ).all()
        by_slug: dict[str, tuple[AgentRow, str | None]] = {}
        for row, name in rows:
            if row.slug not in by_slug or name is not None:
                by_slug[row.slug] = (row, name)
        return [self._pb(row, name or "") for row, name in by_slug.values()]
