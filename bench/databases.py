"""Throwaway PostgreSQL databases for runs that need their own (the chaos run, scenario S): created
beside the admin URL's database, dropped with whatever still holds a connection to them."""

from __future__ import annotations

import uuid


async def create_database(admin_url: str, label: str) -> str:
    """A new empty database `agentmesh_<label>_<random>`; returns its URL."""
    import asyncpg

    name = f"agentmesh_{label}_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return admin_url.rsplit("/", 1)[0] + f"/{name}"


async def drop_database(admin_url: str, url: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')
    finally:
        await conn.close()
