"""One progress line for a run in chunks: chunks done, groups kept, rollouts/s and ETA.

    progress = ChunkProgress("intern-bootcamp", total_chunks=10, done_before=2)
    line = progress.update(groups_kept=40, rollouts=640)    # after each chunk this session commits
    # 'intern-bootcamp: 3/10 chunks, 40 groups kept, 51.2 rollouts/s, ETA 2m13s'

A run with a target of groups counts groups against the target (its chunks are an upper bound, not a plan) and
says so once the target is reached:

    # 'intern-bootcamp: 40/100 groups of target, 3/15 chunks, 51.2 rollouts/s, ETA 2m13s'
    # 'intern-bootcamp: target of 100 groups reached (100%), 5/15 chunks, 51.2 rollouts/s, done'

The flow logs the line (Prefect shows it in the terminal of a CLI run and in
the UI); `python -m factory.progress watch FLOW_RUN_ID` prints a deployment
run's progress lines in a terminal and exits with its final state.
"""

from __future__ import annotations

import argparse
import sys
import time

PROGRESS_PREFIX = "progress: "
"""Log lines starting with this are progress lines (the watcher picks them out)."""


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class ChunkProgress:
    def __init__(self, name: str, *, total_chunks: int, done_before: int = 0, groups_before: int = 0,
                 target_groups: int | None = None, clock=time.monotonic) -> None:
        self.name, self.total, self.done_before = name, total_chunks, done_before
        self.target = target_groups
        """Groups the run stops at (adaptive runs); None for a run of a fixed number of chunks."""
        self.groups_before = groups_before
        """Groups committed by earlier sessions of a resumed run: the line reports the whole run's groups."""
        self.clock = clock
        self.started = clock()
        self.session_chunks = self.groups_kept = self.rollouts = 0

    def update(self, *, groups_kept: int, rollouts: int) -> str:
        """Count one more committed chunk and return the line."""
        self.session_chunks += 1
        self.groups_kept += groups_kept
        self.rollouts += rollouts
        return self.line()

    @property
    def target_reached(self) -> bool:
        return self.target is not None and self.groups_before + self.groups_kept >= self.target

    def line(self) -> str:
        if self.target is not None:
            return self._target_line()
        elapsed = max(self.clock() - self.started, 1e-9)
        done = self.done_before + self.session_chunks
        left = self.total - done
        rate = self.rollouts / elapsed
        if left <= 0:
            eta = "done"
        elif self.session_chunks:
            eta = "ETA " + format_duration(elapsed / self.session_chunks * left)
        else:
            eta = "ETA ?"
        groups = self.groups_before + self.groups_kept
        if not self.session_chunks and self.done_before:  # a resumed run: no rate measured yet (or nothing left)
            speed = "resumed, nothing left to do" if left <= 0 else "resumed"
            return f"{self.name}: {done}/{self.total} chunks, {groups} groups kept, {speed}, {eta}"
        return (f"{self.name}: {done}/{self.total} chunks, {groups} groups kept, "
                f"{rate:.1f} rollouts/s, {eta}")


    def _target_line(self) -> str:
        elapsed = max(self.clock() - self.started, 1e-9)
        done = self.done_before + self.session_chunks
        groups = self.groups_before + self.groups_kept
        chunks = f"{done}/{self.total} chunks"
        speed = f"{self.rollouts / elapsed:.1f} rollouts/s" if self.session_chunks else "resumed" if done else None
        if self.target_reached:
            head = f"target of {self.target} groups reached (100%), {chunks}"
            return f"{self.name}: {head}, {speed}, done" if speed else f"{self.name}: {head}, done"
        if self.groups_kept:
            eta = "ETA " + format_duration(elapsed / self.groups_kept * (self.target - groups))
        else:
            eta = "ETA ?"
        parts = [f"{groups}/{self.target} groups of target", chunks, *([speed] if speed else []), eta]
        return f"{self.name}: " + ", ".join(parts)


def watch(flow_run_id: str, *, poll_s: float = 2.0, stream=sys.stdout) -> int:
    """Print the progress lines of a flow run (and its subflows) until it ends; 0 if it Completed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterParentFlowRunId, LogFilter,
                                                LogFilterFlowRunId, LogFilterTimestamp)
    from prefect.client.schemas.sorting import LogSort

    seen: set[str] = set()
    last = None
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))
            ids = [run.id, *(child.id for child in children)]
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids),
                                                         timestamp=LogFilterTimestamp(after_=last)),
                                    sort=LogSort.TIMESTAMP_ASC, limit=200, offset=0)
            for log in logs:
                last = log.timestamp
                key = str(log.id) if getattr(log, "id", None) else f"{log.timestamp}{log.message}"
                if key in seen:
                    continue
                seen.add(key)
                if log.message.startswith(PROGRESS_PREFIX) or log.level >= 40:
                    print(log.message, file=stream, flush=True)
            if run.state is not None and run.state.is_final():
                message = f" ({run.state.message})" if run.state.message else ""
                print(f"flow run {run.name}: {run.state.name}{message}", file=stream, flush=True)
                return 0 if run.state.is_completed() else 1
            time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m factory.progress", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    watch_parser = sub.add_parser("watch", help="print a flow run's progress lines until it ends")
    watch_parser.add_argument("flow_run_id")
    watch_parser.add_argument("--poll-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    return watch(args.flow_run_id, poll_s=args.poll_s)


if __name__ == "__main__":
    raise SystemExit(main())
