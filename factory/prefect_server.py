"""`prefect server start` for the local stack, with every SQLite write transaction taking the lock when it begins.

Why: the local server keeps everything in one SQLite file (WAL mode, busy_timeout 60 s). Most of Prefect's
writing transactions begin DEFERRED: they read first (a deployment, a work queue, an automation's bucket, the
run's current state) and take the write lock only at their first write. When another connection has committed
in between, that upgrade fails with SQLITE_BUSY at once (the busy timeout does not apply to it), and the server
logs "database is locked" tracebacks, then answers 503 and the client retries. Seen with the zombie-run
automation's trigger evaluation (24 tracebacks in a run of three small flows) and with flow-run creation and
state validation when a user starts many deployment runs at once (65 in one `prefect deployment run` burst of
19 runs, tests/integration/test_deployments.py). Prefect's own remedy for read-then-write transactions on SQLite
is `BEGIN IMMEDIATE` (its `with_for_update=True`, used today only for state changes); this launcher makes every
transaction that Prefect begins on SQLite IMMEDIATE, so a writer waits for the lock (up to busy_timeout) instead
of failing. SQLite admits one writer at a time either way, so this costs no concurrency; reads outside a
transaction are untouched. Nothing else about the server changes.

    python -m factory.prefect_server [prefect server start options]   # what `factory-local up` runs
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any


def use_immediate_write_transactions() -> None:
    """Begin every SQLite transaction Prefect's server opens as `BEGIN IMMEDIATE`; other databases are unaffected."""
    from prefect.server.database.configurations import AioSqliteConfiguration

    original = AioSqliteConfiguration.begin_transaction
    if getattr(original, "factory_immediate", False):
        return

    @asynccontextmanager
    async def begin_transaction(self: Any, session: Any, with_for_update: bool = False) -> AsyncIterator[Any]:
        async with original(self, session, with_for_update=True) as transaction:
            yield transaction

    begin_transaction.factory_immediate = True  # type: ignore[attr-defined]
    AioSqliteConfiguration.begin_transaction = begin_transaction  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    use_immediate_write_transactions()
    from prefect.cli import app

    sys.argv = ["prefect", "server", "start", *(sys.argv[1:] if argv is None else argv)]
    app()


if __name__ == "__main__":
    main()
