"""The trace handlers over the SQL stores on a SQLite file of the module's own: the domain's rules
with a real store behind them and no network."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentmesh.services.trace.agents import load_catalog
from agentmesh.services.trace.handlers.messages import MessageHandler
from agentmesh.services.trace.handlers.subagents import SubagentHandler
from agentmesh.services.trace.handlers.tasks import TaskHandler
from agentmesh.services.trace.handlers.traces import TraceHandler
from agentmesh.services.trace.store.sql import SqlStores
from agentmesh.services.trace.store.sql.db import create_engine, migrate
from agentmesh.trace.v1 import trace_pb2 as tp

CATALOG = Path(__file__).resolve().parents[4] / "services" / "trace" / "demo_catalog.yaml"


@pytest.fixture(scope="module")
async def stores(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SqlStores]:
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('handlers') / 'trace.db'}")
    await migrate(engine)
    opened = SqlStores.open(engine)
    await opened.agents.import_builtins(load_catalog(CATALOG))
    yield opened
    await engine.dispose()


@pytest.fixture
def traces(stores: SqlStores) -> TraceHandler:
    return TraceHandler(stores.traces)


@pytest.fixture
def messages(stores: SqlStores) -> MessageHandler:
    return MessageHandler(stores.messages, stores.subagents)


@pytest.fixture
def tasks(stores: SqlStores) -> TaskHandler:
    return TaskHandler(stores.tasks, stores.traces)


@pytest.fixture
def subagents(stores: SqlStores) -> SubagentHandler:
    return SubagentHandler(stores.subagents)


def user(text: str, **kw: object) -> tp.Message:
    return tp.Message(role=tp.MESSAGE_ROLE_USER, content=text, **kw)  # type: ignore[arg-type]


def assistant(text: str = "", **kw: object) -> tp.Message:
    return tp.Message(role=tp.MESSAGE_ROLE_ASSISTANT, content=text, **kw)  # type: ignore[arg-type]
