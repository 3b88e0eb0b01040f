"""The SQL implementations of the trace service's stores (SQLite via aiosqlite, PostgreSQL via asyncpg)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from agentmesh.libs.config import SubagentDefaults
from agentmesh.services.trace.store.sql.agents import SqlAgentStore
from agentmesh.services.trace.store.sql.common import Database
from agentmesh.services.trace.store.sql.copies import SqlCopyStore
from agentmesh.services.trace.store.sql.keys import SqlKeyStore
from agentmesh.services.trace.store.sql.leases import SqlLeaseStore
from agentmesh.services.trace.store.sql.messages import SqlMessageStore
from agentmesh.services.trace.store.sql.runs import SqlRunStore
from agentmesh.services.trace.store.sql.subagents import SqlSubagentStore
from agentmesh.services.trace.store.sql.tasks import SqlTaskStore
from agentmesh.services.trace.store.sql.traces import SqlTraceStore


@dataclass
class SqlStores:
    """Every store over one database."""

    traces: SqlTraceStore
    messages: SqlMessageStore
    tasks: SqlTaskStore
    subagents: SqlSubagentStore
    agents: SqlAgentStore
    keys: SqlKeyStore
    leases: SqlLeaseStore
    copies: SqlCopyStore
    runs: SqlRunStore

    @classmethod
    def open(
        cls, engine: AsyncEngine, defaults: SubagentDefaults | None = None, lease_s: float = 30.0
    ) -> SqlStores:
        db = Database(engine)
        return cls(
            traces=SqlTraceStore(db),
            messages=SqlMessageStore(db),
            tasks=SqlTaskStore(db),
            subagents=SqlSubagentStore(db),
            agents=SqlAgentStore(db, defaults),
            keys=SqlKeyStore(db),
            leases=SqlLeaseStore(db, lease_s),
            copies=SqlCopyStore(db),
            runs=SqlRunStore(db),
        )
