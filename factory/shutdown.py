"""Graceful stop on SIGTERM/SIGINT: stop taking new work, give work in flight a bounded grace period, then exit.

    with GracefulStop(grace_s=30, on_abandon=mark_cancelled) as stop:
        for chunk in todo:
            if stop.requested: break
            ...
        stop.wait_until(lambda: in_flight_done(), ...)

Schedulers (SLURM, Kubernetes, a Prefect worker cancelling a run) send SIGTERM
and kill a few seconds later. The first signal sets `requested` and starts the
grace clock; a second signal, or the grace period running out (plus a small
margin) while the process is still alive, runs `on_abandon` and exits at once
with 128 + the signal number. Threads still busy with abandoned work cannot
keep the process alive past that bound. Handlers are installed only from the
main thread (elsewhere the object just never fires) and restored on exit.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

FORCE_MARGIN_S = 3.0
"""Extra seconds after the grace period before the watchdog forces the exit."""


def hard_exit(code: int, last_line: str | None = None, *, drain_s: float = 3) -> None:
    """Flush what can be flushed (std streams, Prefect's log and event queues), print `last_line` to stderr if
    given (after everything else, so it stays last) and leave now."""
    try:
        from factory.local_prefect import drain_prefect_workers

        drain_prefect_workers(timeout=drain_s)
    except Exception:  # noqa: BLE001 - leaving anyway
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    if last_line is not None:
        # Threads still running (Prefect's log worker) may write after this point, and may have left a line
        # unfinished (its "--- Error logging to API ---" report ends without a newline): silence them and start ours on
        # a line of its own, written straight to the descriptor.
        sys.stdout = sys.stderr = open(os.devnull, "w")
        os.write(2, f"\n{last_line}\n".encode())
    os._exit(code)


class GracefulStop:
    def __init__(self, grace_s: float, *, on_abandon: Callable[[str], None] | None = None,
                 signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.grace_s = grace_s
        self.on_abandon = on_abandon
        self.signals = signals
        self.signum: int | None = None
        self.deadline: float | None = None
        self._event = threading.Event()
        self._previous: dict[int, object] = {}
        self._abandoning = threading.Lock()
        self._disarmed = threading.Event()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "stop"

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic()) if self.deadline is not None else float("inf")

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def request(self, signum: int = signal.SIGTERM) -> None:
        """What the handler does; callable directly (tests, a cancel request seen another way)."""
        if self._event.is_set():
            return
        self.signum = signum
        self.deadline = time.monotonic() + self.grace_s
        self._event.set()
        threading.Thread(target=self._watchdog, name="graceful-stop-watchdog", daemon=True).start()

    def _handle(self, signum: int, frame: object) -> None:
        if self._event.is_set():
            logger.warning("second %s: abandoning work in flight now", signal.Signals(signum).name)
            self.abandon(f"second {signal.Signals(signum).name}")
        self.request(signum)
        logger.warning("%s received: taking no new work; work in flight has %gs to finish",
                       self.signal_name, self.grace_s)

    def disarm(self) -> None:
        """Stop the watchdog from forcing the exit (tests; a caller that exits by itself)."""
        self._disarmed.set()

    def _watchdog(self) -> None:
        if self._disarmed.wait(self.grace_s + FORCE_MARGIN_S):
            return
        logger.warning("still running %gs after %s: abandoning work in flight", self.grace_s + FORCE_MARGIN_S,
                       self.signal_name)
        self.abandon(f"grace period of {self.grace_s:g}s after {self.signal_name} ran out")

    def abandon(self, reason: str) -> None:
        """Run `on_abandon(reason)` once and exit with 128 + signal number."""
        if self._abandoning.acquire(blocking=False):
            try:
                if self.on_abandon is not None:
                    self.on_abandon(reason)
            except Exception as error:  # noqa: BLE001 - exiting anyway
                logger.warning("while abandoning: %s", error)
            hard_exit(128 + (self.signum or signal.SIGTERM))
        else:  # another thread is already abandoning; it exits the process
            time.sleep(60)
