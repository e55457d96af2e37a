"""`prefect server start` for the local stack, with the event-trigger transactions that write taking SQLite's lock first.

Why: the local server keeps everything in one SQLite file (WAL mode, busy_timeout 60 s). Prefect's trigger
service evaluates each flow-run event against the automations (here the zombie-run automation that
`factory-local up` installs) in a transaction that reads the automation's bucket and then writes it, in two
consumer loops at once, beside the event persister and the task-run recorder. A deferred SQLite transaction
that has read and then tries to write after another connection committed gets SQLITE_BUSY at once (the busy
timeout does not apply to that upgrade), which the server logged as "database is locked" tracebacks (24 in a run
of three small flows) before retrying the event. Prefect's own remedy for read-then-write transactions is
`BEGIN IMMEDIATE` (its `with_for_update=True`); this launcher makes the trigger transactions use it, so they wait
for the lock (up to busy_timeout) instead of failing. Nothing else about the server changes.

    python -m factory.prefect_server [prefect server start options]   # what `factory-local up` runs
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


def use_immediate_trigger_transactions() -> None:
    """Make the trigger service's writing transactions `BEGIN IMMEDIATE` (SQLite); other databases are unaffected."""
    from prefect.server.database import provide_database_interface
    from prefect.server.events import triggers

    original = triggers.automations_session

    @asynccontextmanager
    async def automations_session(begin_transaction: bool = False) -> AsyncIterator[object]:
        if not begin_transaction:
            async with original() as session:
                yield session
            return
        db = provide_database_interface()
        async with db.session_context(begin_transaction=True, with_for_update=True) as session:
            yield session

    triggers.automations_session = automations_session


def main(argv: list[str] | None = None) -> None:
    use_immediate_trigger_transactions()
    from prefect.cli import app

    sys.argv = ["prefect", "server", "start", *(sys.argv[1:] if argv is None else argv)]
    app()


if __name__ == "__main__":
    main()
