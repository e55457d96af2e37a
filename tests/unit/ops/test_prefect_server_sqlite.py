"""factory/prefect_server.py: every transaction Prefect's server begins on SQLite holds the write lock from BEGIN.

A DEFERRED transaction that reads and then writes fails with "database is locked" when another connection wrote
in between; an IMMEDIATE one cannot be overtaken. Checked on a real SQLite file through Prefect's own database
configuration: while the patched transaction is open (before it has written anything), a second connection's
write is refused; with Prefect's default it goes through.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest


def other_connection_can_write(path: Path) -> bool:
    other = sqlite3.connect(path, timeout=0.1)
    try:
        other.execute("INSERT INTO t VALUES (2)")
        other.commit()
        return True
    except sqlite3.OperationalError as error:
        assert "locked" in str(error)
        return False
    finally:
        other.close()


async def write_allowed_inside_a_transaction(path: Path) -> bool:
    import sqlalchemy as sa
    from prefect.server.database.configurations import AioSqliteConfiguration

    config = AioSqliteConfiguration(connection_url=f"sqlite+aiosqlite:///{path}")
    engine = await config.engine()
    try:
        session = await config.session(engine)
        async with session:
            async with config.begin_transaction(session):
                await session.execute(sa.text("SELECT count(*) FROM t"))  # a read first, as Prefect's writers do
                return await asyncio.to_thread(other_connection_can_write, path)
    finally:
        await engine.dispose()


@pytest.fixture
def database(tmp_path: Path) -> Path:
    path = tmp_path / "prefect.db"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE t (x INTEGER)")
    return path


def test_prefects_default_transaction_can_be_overtaken(database: Path) -> None:
    assert asyncio.run(write_allowed_inside_a_transaction(database)) is True


def test_the_launchers_transactions_hold_the_lock_from_begin(database: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.server.database.configurations import AioSqliteConfiguration

    from factory.prefect_server import use_immediate_write_transactions

    monkeypatch.setattr(AioSqliteConfiguration, "begin_transaction", AioSqliteConfiguration.begin_transaction)
    use_immediate_write_transactions()
    use_immediate_write_transactions()  # idempotent: wrapping twice changes nothing
    assert getattr(AioSqliteConfiguration.begin_transaction, "factory_immediate", False)
    assert asyncio.run(write_allowed_inside_a_transaction(database)) is False
