"""Agents in SQL: the built-in set (owner NULL) and users' own agents (slug unique per owner)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import delete, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.libs.config import SubagentDefaults
from agentmesh.libs.errors import AlreadyExists, NotFound, PermissionDenied, VersionMismatch
from agentmesh.services.trace import agents as domain
from agentmesh.services.trace.domain import need_owner
from agentmesh.services.trace.store.base import AgentStore
from agentmesh.services.trace.store.sql.common import AGENT_AS_READ, Database, now, own_first, ts
from agentmesh.services.trace.store.sql.models import AgentRow, User

_IMPORT_ATTEMPTS = 3  # after one replica commits, every catalog slug exists: no insert is left to race
_PARSED_MAX = 10_000


class SqlAgentStore(AgentStore):
    def __init__(self, db: Database, defaults: SubagentDefaults | None = None) -> None:
        self.db = db
        self.defaults = defaults or SubagentDefaults()
        # Agents as read, by row id, version and update time (a row deleted and made anew may get
        # its id back): the row is read on every get (an edit anywhere applies at once), its stored
        # config parsed once per version.
        self._parsed: dict[tuple[Any, ...], ap.Agent] = {}

    def _pb(self, row: Any, owner: str) -> ap.Agent:
        """`row`: an AgentRow, or a Core row with its slug, config, version and times."""
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
        """Core, not ORM, and one statement built once: every turn and run reads its agent."""

        async def work(conn: AsyncConnection) -> list[Any]:
            return list((await conn.execute(AGENT_AS_READ, {"slug": slug, "owner": owner})).all())

        row = own_first(await self.db.run(work))
        if row is None:
            raise NotFound(f"unknown agent {slug!r}")
        key = (row.id, row.version, row.updated_at, row.name)
        parsed = self._parsed.get(key)
        if parsed is None:
            if len(self._parsed) > _PARSED_MAX:
                self._parsed.clear()
            parsed = self._parsed[key] = self._pb(row, row.name or "")
        out = ap.Agent()
        out.CopyFrom(parsed)
        return out

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

    async def create_agent(self, owner: str, agent: ap.Agent) -> ap.Agent:
        need_owner(owner)
        try:
            async with self.db.tx() as db:
                stamp = now()
                row = AgentRow(
                    slug=agent.slug,
                    owner_user_id=await self.db.user_id(db, owner),
                    version=1,
                    created_at=stamp,
                    updated_at=stamp,
                )
                self._write(row, agent)
                db.add(row)
                await db.flush()
        except IntegrityError as exc:
            raise AlreadyExists(f"you already have an agent {agent.slug!r}") from exc
        return self._pb(row, owner)

    async def update_agent(
        self,
        owner: str,
        slug: str,
        change: Callable[[ap.Agent], ap.Agent],
        expected_version: int = 0,
    ) -> ap.Agent:
        async with self.db.tx() as db:
            row = await self._own_row(db, owner, slug, expected_version)
            new = change(self._pb(row, owner))
            if domain.to_json(new) != row.config or bool(row.public) != new.public:
                self._write(row, new)
                row.version += 1
                row.updated_at = now()
        return self._pb(row, owner)

    async def delete_agent(self, owner: str, slug: str, expected_version: int = 0) -> None:
        async with self.db.tx() as db:
            row = await self._own_row(db, owner, slug, expected_version)
            # The database clears the references (ON DELETE SET NULL): messages, tasks and subagent
            # rows stay.
            await db.execute(delete(AgentRow).where(AgentRow.id == row.id))

    @staticmethod
    def _write(row: AgentRow, agent: ap.Agent) -> None:
        row.name, row.description, row.model = agent.name, agent.description, agent.model
        row.config, row.public = domain.to_json(agent), int(agent.public)

    async def _own_row(self, db: AsyncSession, owner: str, slug: str, expected_version: int) -> AgentRow:
        """The owner's own agent, locked for the write, at the expected version (0: any)."""
        need_owner(owner)
        row = await db.scalar(
            select(AgentRow)
            .where(AgentRow.slug == slug, AgentRow.owner_user_id == self.db.owner_uid(owner))
            .with_for_update()
        )
        if row is None:
            builtin = await db.scalar(
                select(AgentRow.id).where(AgentRow.slug == slug, AgentRow.owner_user_id.is_(None))
            )
            if builtin is not None:
                raise PermissionDenied(f"built-in agent {slug!r} is read-only: clone it to change it")
            raise NotFound(f"unknown agent {slug!r}")
        if expected_version and expected_version != row.version:
            raise VersionMismatch(
                f"agent {slug!r} is at version {row.version}, not {expected_version}: "
                "read it again and redo the change"
            )
        return row
