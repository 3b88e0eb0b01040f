"""Users and API keys in SQL: only a key's sha256 is stored."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select, update

from agentmesh.libs.errors import InvalidArgument, Unauthenticated
from agentmesh.services.trace.store.base import KeyStore
from agentmesh.services.trace.store.sql.common import Database, now
from agentmesh.services.trace.store.sql.models import ApiKey, User


def _hash(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class SqlKeyStore(KeyStore):
    def __init__(self, db: Database) -> None:
        self.db = db

    async def authenticate(self, api_key: str) -> str:
        if not api_key:
            raise Unauthenticated("missing API key")
        async with self.db.tx() as db:
            found = (
                await db.execute(
                    select(ApiKey.id, User.name)
                    .join(User, User.id == ApiKey.user_id)
                    .where(ApiKey.key_hash == _hash(api_key))
                )
            ).first()
            if found is None:
                raise Unauthenticated("invalid API key")
            await db.execute(update(ApiKey).where(ApiKey.id == found.id).values(last_used_at=now()))
            return str(found.name)

    async def create_api_key(self, user: str) -> str:
        if not user or len(user) > 200:
            raise InvalidArgument("user must be 1-200 characters")
        key = "am_" + secrets.token_urlsafe(32)
        async with self.db.tx() as db:
            uid = await self.db.user_id(db, user)
            db.add(ApiKey(user_id=uid, key_hash=_hash(key), prefix=key[:10], created_at=now()))
        return key
