"""One word for one concept: the table `sessions` is `traces`, and every column that names a trace by
a session says so (`messages.trace_id`, `caller_trace_id`; `a2a_tasks.trace_id`, `caller_trace_id`;
`subagent_sessions.trace_id`, `child_trace_id`), with the indexes and constraints named after them. The
rows stay as they are. `subagent_sessions` keeps its name (the requirements' name of that table).

PostgreSQL renames in place. SQLite renames the table and the columns in place (it rewrites the
references to them), then rebuilds the tables whose constraint names say `session` (a constraint of
SQLite is part of its table's definition) and recreates the renamed indexes.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, old column, new column)
COLUMNS = (
    ("messages", "session_id", "trace_id"),
    ("messages", "caller_session_id", "caller_trace_id"),
    ("a2a_tasks", "session_id", "trace_id"),
    ("a2a_tasks", "caller_session_id", "caller_trace_id"),
    ("subagent_sessions", "session_id", "trace_id"),
    ("subagent_sessions", "child_session_id", "child_trace_id"),
)
# Plain indexes: (table, old name, new name, columns (new names), unique, partial WHERE)
INDEXES = (
    ("traces", "idx_sessions_user_updated", "idx_traces_user_updated", ["user_id", "updated_at"], False, ""),
    ("traces", "uq_sessions_user_home", "uq_traces_user_home", ["user_id", "home"], True, "home IS NOT NULL"),
    ("a2a_tasks", "ix_a2a_tasks_session_id", "ix_a2a_tasks_trace_id", ["trace_id"], False, ""),
    (
        "a2a_tasks", "ix_a2a_tasks_caller_session_id", "ix_a2a_tasks_caller_trace_id",
        ["caller_trace_id"], False, "",
    ),
    (
        "subagent_sessions", "ix_subagent_sessions_child_session_id", "ix_subagent_sessions_child_trace_id",
        ["child_trace_id"], False, "",
    ),
)  # fmt: skip
# Constraints: (table, old name, new name)
CONSTRAINTS = (
    ("traces", "pk_sessions", "pk_traces"),
    ("traces", "fk_sessions_user_id_users", "fk_traces_user_id_users"),
    ("messages", "uq_messages_session_sequence", "uq_messages_trace_sequence"),
    ("messages", "fk_messages_session_id_sessions", "fk_messages_trace_id_traces"),
    ("a2a_tasks", "fk_a2a_tasks_session_id_sessions", "fk_a2a_tasks_trace_id_traces"),
    ("a2a_tasks", "fk_a2a_tasks_caller_session_id_sessions", "fk_a2a_tasks_caller_trace_id_traces"),
    ("subagent_sessions", "fk_subagent_sessions_session_id_sessions", "fk_subagent_sessions_trace_id_traces"),
    (
        "subagent_sessions",
        "fk_subagent_sessions_child_session_id_sessions",
        "fk_subagent_sessions_child_trace_id_traces",
    ),
)


def _flip(pairs: Sequence[tuple[str, str, str]], backwards: bool) -> list[tuple[str, str, str]]:
    """(table, from, to) of each rename, the way this run goes."""
    return [(t, b, a) if backwards else (t, a, b) for t, a, b in pairs]


def _rename(backwards: bool) -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    if not backwards:
        op.rename_table("sessions", "traces")
    for table, old, new in _flip(COLUMNS, backwards):
        op.execute(f"ALTER TABLE {table} RENAME COLUMN {old} TO {new}")
    if backwards:
        op.rename_table("traces", "sessions")
    traces = "sessions" if backwards else "traces"
    indexes = [
        (
            traces if table == "traces" else table,
            *((new, old) if backwards else (old, new)),
            columns,
            unique,
            where,
        )
        for table, old, new, columns, unique, where in INDEXES
    ]
    constraints = [
        (traces if t == "traces" else t, old, new) for t, old, new in _flip(CONSTRAINTS, backwards)
    ]
    if not sqlite:
        for _table, old, new, *_ in indexes:
            op.execute(f"ALTER INDEX {old} RENAME TO {new}")
        for table, old, new in constraints:
            op.execute(f"ALTER TABLE {table} RENAME CONSTRAINT {old} TO {new}")
        return
    # SQLite: a constraint's name is part of its table's definition, so the table is rebuilt with the
    # new name (batch mode copies it); its indexes that need a new name are dropped and made again.
    for table, old, _new, *_ in indexes:
        op.drop_index(old, table_name=table)
    for table in ("messages", "a2a_tasks", "subagent_sessions", traces):
        _rebuild_sqlite(table, [(old, new) for t, old, new in constraints if t == table])
    for table, _old, new, columns, unique, where in indexes:
        columns = [_column(c) if backwards else c for c in columns]
        op.create_index(new, table, columns, unique=unique, sqlite_where=sa.text(where) if where else None)


def _column(name: str) -> str:
    """The name before this migration of a column it renames."""
    return next((old for _table, old, new in COLUMNS if new == name), name)


def _rebuild_sqlite(table: str, renames: list[tuple[str, str]]) -> None:
    """Rebuilds `table` with its constraints named anew (old, new): foreign keys, unique ones, the
    primary key."""
    inspector = sa.inspect(op.get_bind())
    fks = {fk["name"]: fk for fk in inspector.get_foreign_keys(table)}
    uniques = {uq["name"]: uq for uq in inspector.get_unique_constraints(table)}
    with op.batch_alter_table(table, recreate="always") as batch:
        for old, new in renames:
            if old in fks:
                fk = fks[old]
                batch.drop_constraint(old, type_="foreignkey")
                batch.create_foreign_key(
                    new,
                    fk["referred_table"],
                    fk["constrained_columns"],
                    fk["referred_columns"],
                    ondelete=fk.get("options", {}).get("ondelete"),
                )
            elif old in uniques:
                batch.drop_constraint(old, type_="unique")
                batch.create_unique_constraint(new, uniques[old]["column_names"])
            else:  # the primary key (of `id`)
                batch.create_primary_key(new, ["id"])


def upgrade() -> None:
    _rename(backwards=False)


def downgrade() -> None:
    _rename(backwards=True)
