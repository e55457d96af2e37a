"""One line for a run that failed because the Prefect API stopped answering, naming the API's URL.

Without it a Prefect outage ends a datagen run with a bare `ConnectError`
that names neither Prefect nor where it was expected.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator


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


# ---- riding out an outage --------------------------------------------------------------------------------------

OUTAGE_WINDOW_ENV = "FACTORY_PREFECT_OUTAGE_S"
DEFAULT_OUTAGE_WINDOW_S = 300.0
"""How long a run waits out a Prefect API outage by default before failing with `describe_prefect_outage`'s line."""


def client_max_retries(window_s: float) -> int:
    """PREFECT_CLIENT_MAX_RETRIES whose back-off covers `window_s` seconds of outage.

    Prefect's client waits 2**k seconds before retry k (k = 1, 2, ..., no cap; +-20% jitter by default) and, once it
    has reached the server, retries connection errors too; n retries wait 2**(n+1) - 2 seconds in all. Its default of
    5 rides out about a minute.
    """
    retries = 1
    while 2 ** (retries + 1) - 2 < window_s:
        retries += 1
    return retries


def ridden_out_s(max_retries: int) -> int:
    """Seconds of outage `max_retries` retries wait out (without jitter)."""
    return 2 ** (max_retries + 1) - 2


def outage_environ(window_s: float | None = None) -> dict[str, str]:
    """The Prefect client settings a process needs to ride out an outage of `window_s` (default: FACTORY_PREFECT_OUTAGE_S,
    else 300 s): exported by `factory-local env`/`up` to flows, the worker and the runs it starts."""
    if window_s is None:
        window_s = float(os.environ.get(OUTAGE_WINDOW_ENV) or DEFAULT_OUTAGE_WINDOW_S)
    return {"PREFECT_CLIENT_MAX_RETRIES": os.environ.get("PREFECT_CLIENT_MAX_RETRIES", str(client_max_retries(window_s)))}


def client_outage_window_s() -> float:
    """Seconds of outage this process's Prefect client rides out (PREFECT_CLIENT_MAX_RETRIES's back-off)."""
    try:
        from prefect.settings import PREFECT_CLIENT_MAX_RETRIES

        return float(ridden_out_s(int(PREFECT_CLIENT_MAX_RETRIES.value())))
    except Exception:  # noqa: BLE001 - settings that do not load: the environment, else Prefect's default of 5
        return float(ridden_out_s(int(os.environ.get("PREFECT_CLIENT_MAX_RETRIES") or 5)))


class ApiWatch:
    """Whether the Prefect API still answers, for a run whose data path makes no API call of its own.

    A datagen chunk is one task run whose states Prefect reports as events, in the background; nothing in the data
    path waits on the API, so without a check a run would go on while the API is gone and only fail at its end.
    `check()` is called between chunks: at most every `every_s` it GETs /health (one cheap request, 1 s timeout);
    once the API has not answered for `window_s` (the client's own retry window) it raises `PrefectApiGone`,
    chained to the failed request, so the run ends with `describe_prefect_outage`'s line. While the API is down,
    `best_effort` reports are skipped instead of each waiting out the client's retries.
    """

    def __init__(self, api_url: str, *, window_s: float | None = None, every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, probe: Callable[[str], None] | None = None) -> None:
        self.health_url = api_url.rstrip("/") + "/health"
        self.window_s = client_outage_window_s() if window_s is None else window_s
        self.every_s, self.clock = every_s, clock
        self.probe = probe or _get_health
        self.last_probe: float | None = None
        self.down_since: float | None = None

    def check(self) -> None:
        now = self.clock()
        if self.last_probe is not None and now - self.last_probe < self.every_s:
            return
        self.last_probe = now
        global _api_down
        try:
            self.probe(self.health_url)
        except Exception as error:  # noqa: BLE001 - any failure to get an answer counts as down
            if self.down_since is None:
                self.down_since = now
            _api_down = True
            if now - self.down_since >= self.window_s:
                raise PrefectApiGone(f"no answer from {self.health_url} for {now - self.down_since:.0f}s") from error
        else:
            self.down_since, _api_down = None, False


class PrefectApiGone(RuntimeError):
    """The Prefect API has not answered for the run's outage window (its cause is the last failed request)."""


def _get_health(url: str) -> None:
    import httpx

    httpx.get(url, timeout=1.0).raise_for_status()


_reported: set[str] = set()
_api_down = False
"""Set by ApiWatch while the API does not answer: best_effort reports are skipped, not retried for minutes."""


def best_effort(call, *args, what: str = "a progress report", **kwargs):
    """`call(*args, **kwargs)` for a report the run can do without (progress, artifacts); a Prefect outage makes it a
    warning (once per kind) instead of failing a run whose data path does not need the API."""
    import logging

    import httpx

    if _api_down:
        return None
    try:
        return call(*args, **kwargs)
    except (httpx.TransportError, httpx.HTTPStatusError, OSError) as error:
        if what not in _reported:
            _reported.add(what)
            logging.getLogger(__name__).warning("skipped %s: %s", what,
                                                describe_prefect_outage(error) or f"{type(error).__name__}: {error}")
        return None


def exit_with_outage(line: str, code: int = 1) -> None:
    """Print `error: line` as the very last line and leave: Prefect's log and event workers would otherwise print
    their own failures to reach the API (tracebacks, event dumps) after it, at interpreter exit."""
    import logging

    from factory.shutdown import hard_exit

    logging.disable(logging.CRITICAL)
    logging.raiseExceptions = False  # Prefect's log worker reports its own failed uploads to stderr unless this is off
    hard_exit(code, f"error: {line}", drain_s=2)
