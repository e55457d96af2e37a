"""One line for a run that failed because the Prefect API stopped answering, naming the API's URL.

Without it a Prefect outage ends a datagen run with a bare `ConnectError`
that names neither Prefect nor where it was expected.
"""

from __future__ import annotations

import os
from collections.abc import Iterator


def prefect_api_url() -> str | None:
    """The Prefect API this process talks to (None: Prefect's temporary, in-process server)."""
    try:
        from prefect.settings import PREFECT_API_URL

        return PREFECT_API_URL.value() or None
    except Exception:  # noqa: BLE001 - no Prefect, or settings that do not load: fall back to the environment
        return os.environ.get("PREFECT_API_URL") or None


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [error]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
        todo += list(getattr(current, "exceptions", ()) or ())


def describe_prefect_outage(error: BaseException, api_url: str | None = None) -> str | None:
    """A one-line cause if `error` (or what caused it) is a failed request to the Prefect API, else None."""
    import httpx

    url = (api_url if api_url is not None else prefect_api_url()) or ""
    for cause in _chain(error):
        if not isinstance(cause, httpx.TransportError):
            continue
        try:
            target = str(cause.request.url)
        except RuntimeError:  # an error raised without its request
            target = ""
        if url and target and not target.startswith(url.rstrip("/")):
            continue  # a request to something else (an inference server, the batching API)
        where = url or target or "(PREFECT_API_URL is not set)"
        return (
            f"the Prefect API at {where} stopped answering ({type(cause).__name__}: {cause}); committed chunks are "
            "kept: start the server again (`factory-local up`, or check PREFECT_API_URL) and rerun with the same "
            "run id to finish the rest"
        )
    return None
