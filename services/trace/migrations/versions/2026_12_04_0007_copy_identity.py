"""A cached copy keeps its home's identity: each copied message remembers its id at home (`home_id`,
shown in place of the row's own id) and its caller agent there (`home_caller_agent`: a slug of the
peer's, which no row of our `agents` table names). NULL on every row of this mesh's own traces.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 19:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("messages", sa.Column("home_id", sa.BigInteger(), nullable=True))
    op.add_column("messages", sa.Column("home_caller_agent", sa.String(length=100), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("home_caller_agent")
        batch.drop_column("home_id")
