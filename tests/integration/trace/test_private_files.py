"""Files the mesh keeps are private (issue 39, point 5): the data directory 0700, the SQLite database
(hashed keys, every message; it was created 0644) with its WAL and shared-memory files, the mesh secret
and the development API key 0600, whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentmesh.libs.files import private_dir, write_private
from agentmesh.libs.identity import load_secret
from agentmesh.services.trace.server import build
from tests.conftest import service_settings


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0o022)  # what most shells give: files 0644, directories 0755
    try:
        yield
    finally:
        os.umask(old)


async def test_the_database_and_its_directory_are_private(tmp_path: Path, open_umask: None) -> None:
    data_dir = tmp_path / "data"
    server = await build(service_settings(data_dir=data_dir), "127.0.0.1:0")
    try:
        files = {p.name: mode(p) for p in data_dir.iterdir()}
    finally:
        await server.stop(0)
    assert mode(data_dir) == 0o700
    assert "agentmesh.db" in files and "agentmesh.db-wal" in files, files
    assert {name: m for name, m in files.items() if m != 0o600} == {}


def test_the_mesh_secret_is_private(tmp_path: Path, open_umask: None) -> None:
    data_dir = tmp_path / "fresh"
    assert load_secret("", data_dir)
    assert (mode(data_dir), mode(data_dir / "mesh_secret")) == (0o700, 0o600)


def test_an_existing_data_dir_and_key_file_are_narrowed(tmp_path: Path, open_umask: None) -> None:
    data_dir = tmp_path / "old"
    data_dir.mkdir(mode=0o755)
    key = data_dir / "dev_api_key"
    key.write_text("am_old\n")
    key.chmod(0o644)
    private_dir(data_dir)
    write_private(key, "am_new\n")
    assert (mode(data_dir), mode(key), key.read_text()) == (0o700, 0o600, "am_new\n")
