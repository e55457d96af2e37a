"""Server memory through ingest, drain and after, side by side: rollout-factory's run-api vs atroposlib 0.4.0's.

    python -m bench.serve.drain_rss                      # 1000 groups 1 per request, 2 interleaved pairs
    python -m bench.serve.drain_rss --groups 2000 --per-request 64 --pairs 3
    python -m bench.serve.drain_rss --smoke              # seconds: 32 groups of 8 x 128 tokens, one pair
    python -m bench.serve.drain_rss --versus /tmp/base   # and ours from an older checkout (git archive), interleaved
    ATROPOS_VENV=/work/.venv-atropos python -m bench.serve.drain_rss

Each round starts each server fresh (atropos, then ours), registers a trainer
(batches of 256 sequences) and an env, waits 1 s (idle), posts and drains one
batch of tiny groups (8 x 16 tokens; "idle after a first batch": what the
first post loads is loaded, pyarrow on our side), and then reads the server's
/proc/<pid>/status every 50 ms in a thread (VmRSS, VmHWM, RssAnon, RssFile,
summed over the server's process tree) through three phases; at each phase's
start the kernel's peak (VmHWM) is reset (/proc/<pid>/clear_refs), so each
phase's peak is exact, not only the largest 50 ms sample:
- ingest: N distinct groups of 8 x 1024 tokens posted on Atropos's harness
  settings (plain JSON bodies, 8 clients, one persistent aiohttp connection
  each, no warm-up), `--per-request` groups per post;
- drain: GET /batch until it answers no batch;
- after: `--after` seconds with nothing to do.
The table gives idle (just before ingest), the peaks of ingest and drain, RSS
at the end of `after`, and two ratios within each server: drain peak / ingest
peak (issue 29's bound: at most 1) and after-drain / idle (at most 1.2), also
against the idle after a first batch.
RssFile is the part backed by files (shared libraries, mostly): pages of a
library loaded on the first post (pyarrow) stay resident until memory is
short, so the RssAnon rows say how much of the heap came back.
JSON lines go to a temporary directory unless `--record` (bench/results/serve-memory.jsonl).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson
import psutil

from bench.atropos_venv import DEFAULT_VENV, atropos_available
from bench.harness import Side, add_bench_args, compare, json_path, pairs_from, print_comparison
from bench.serve.run import GROUP_SIZE, Load, atropos_command, make_groups, ours_command, post_all
from factory.serve.client import ApiProcess, EnvClient, TrainerClient
from tests.conftest import free_port

BATCH = 256
FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def proc_memory(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon and RssFile in MiB, summed over `pid` and its descendants."""
    pids = [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    total = dict.fromkeys(FIELDS, 0.0)
    for one in pids:
        try:
            text = Path(f"/proc/{one}/status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            if key in total:
                total[key] += int(rest.split()[0]) / 1024
    return total


def reset_peak(pid: int) -> bool:
    """Reset VmHWM of `pid` and its descendants to their RSS now (Linux: "5" > /proc/<pid>/clear_refs); whether it could."""
    done = False
    for one in [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]:
        try:
            Path(f"/proc/{one}/clear_refs").write_text("5")
            done = True
        except OSError:
            pass
    return done


class Timeline:
    """/proc memory of a process every `interval` s in a thread, each sample tagged with the phase it fell in.

    `enter(phase)` also resets the kernel's peak (VmHWM) and keeps the one of the phase that ended, so a phase's
    peak is exact, not only the largest of its samples."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid, self.interval, self.phase = pid, interval, "idle"
        self.samples: list[tuple[float, str, dict[str, float]]] = []
        self.hwm: dict[str, float] = {}
        self._hwm_exact = reset_peak(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def enter(self, phase: str) -> None:
        ended = self.sample()
        if self._hwm_exact:
            self.hwm[self.phase] = ended["VmHWM"]
            reset_peak(self.pid)
        self.phase = phase

    def __enter__(self) -> Timeline:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def sample(self) -> dict[str, float]:
        value = proc_memory(self.pid)
        self.samples.append((time.monotonic(), self.phase, value))
        return value

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except psutil.Error:
                return

    def peak(self, phase: str, field: str = "VmRSS") -> float:
        """The phase's peak: the kernel's VmHWM over it where it could be reset, else the largest sample."""
        sampled = max((value[field] for _, name, value in self.samples if name == phase), default=float("nan"))
        return max(sampled, self.hwm.get(phase, 0.0)) if field == "VmRSS" else sampled


def drain(url: str) -> int:
    """GET /batch until the server has no batch; sequences received."""
    sequences = 0
    with httpx.Client(base_url=url, timeout=600) as http:
        while True:
            batch = orjson.loads(http.get("/batch").content)["batch"]
            if not batch:
                return sequences
            sequences += sum(len(group["tokens"]) for group in batch)


def first_use(url: str) -> None:
    """One batch's worth of tiny groups (8 x 16 tokens) posted and drained: what a first post loads gets loaded."""
    small = [orjson.dumps(group) for group in make_groups(BATCH // GROUP_SIZE, start=10**6, seq_len=16)]
    asyncio.run(post_all(url, small, "/scored_data", Load()))
    drain(url)


def measure(name: str, groups: int, per_request: int, seq_len: int, after_s: float,
            pythonpath: str | None = None) -> dict[str, float]:
    """One fresh server of `name` ('ours' or 'atropos'): its memory idle, after a first batch of tiny groups, then
    through ingest, drain and `after_s` after. `pythonpath`: ours from that checkout instead of this one."""
    made = make_groups(groups, seq_len=seq_len)
    payloads = [orjson.dumps(made[i] if per_request == 1 else made[i : i + per_request])
                for i in range(0, groups, per_request)]
    del made
    path = "/scored_data" if per_request == 1 else "/scored_data_list"
    with tempfile.TemporaryDirectory(prefix="bench-serve-memory-") as root:
        port = free_port()
        command = ours_command(port, root) if name == "ours" else atropos_command(port)
        env = None
        if pythonpath:  # -P: not the current directory (this checkout) ahead of PYTHONPATH
            command, env = [command[0], "-P", *command[1:]], {"PYTHONPATH": pythonpath}
        with ApiProcess(command, port, env=env, log_path=str(Path(root) / "api.log")) as api:
            trainer = TrainerClient(api.url, timeout=60)
            trainer.register(BATCH, max_token_len=seq_len * 2)
            trainer.batch()  # the trainer has started: envs may register
            EnvClient(api.url, timeout=60).register("bench", GROUP_SIZE, max_token_length=seq_len)
            time.sleep(1.0)
            with Timeline(api.process.pid) as timeline:
                idle = timeline.sample()
                first_use(api.url)
                time.sleep(1.0)
                httpx.get(api.url + "/", timeout=60)
                loaded = timeline.sample()
                timeline.enter("ingest")
                asyncio.run(post_all(api.url, payloads, path, Load()))
                timeline.enter("drain")
                sequences = drain(api.url)
                timeline.enter("after")
                time.sleep(after_s)
                httpx.get(api.url + "/", timeout=60)  # answered: not a process half-way through a start (a recycle)
                end = timeline.sample()
            if sequences < groups * GROUP_SIZE - BATCH:
                raise RuntimeError(f"{name}: drained {sequences} of {groups * GROUP_SIZE} sequences")
    ingest_peak, drain_peak = timeline.peak("ingest"), timeline.peak("drain")
    return {
        "RSS MiB idle": idle["VmRSS"],
        "RSS MiB idle after a first batch": loaded["VmRSS"],
        "RSS MiB peak during ingest": ingest_peak,
        "RSS MiB peak during drain": drain_peak,
        f"RSS MiB {after_s:g} s after the drain": end["VmRSS"],
        "RSS MiB peak after the drain": timeline.peak("after"),
        "RssAnon MiB idle": idle["RssAnon"],
        "RssAnon MiB peak during drain": timeline.peak("drain", "RssAnon"),
        f"RssAnon MiB {after_s:g} s after the drain": end["RssAnon"],
        "RssFile MiB idle": idle["RssFile"],
        f"RssFile MiB {after_s:g} s after the drain": end["RssFile"],
        "drain peak / ingest peak, within the server": drain_peak / ingest_peak,
        "after drain / idle, within the server": end["VmRSS"] / idle["VmRSS"],
        "after drain / idle after a first batch, within the server": end["VmRSS"] / loaded["VmRSS"],
        "RssAnon after drain / idle, within the server": end["RssAnon"] / idle["RssAnon"],
    }


def print_within(result, after_s: float) -> None:
    """Issue 29's two bounds, per server and round (ratios within one server, not between them)."""
    print("\n| server | round | drain peak / ingest peak (<= 1) | after drain / idle (<= 1.2) "
          "| after drain / idle after a first batch | RssAnon after / idle |")
    print("|---|---:|---:|---:|---:|---:|")
    for side in result.sides:
        values = result.values[side]
        for i, row in enumerate(zip(*(values[metric] for metric in (
                "drain peak / ingest peak, within the server", "after drain / idle, within the server",
                "after drain / idle after a first batch, within the server",
                "RssAnon after drain / idle, within the server")))):
            print(f"| {side} | {i} | " + " | ".join(f"{value:.2f}" for value in row) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(parser, pairs=2)
    parser.add_argument("--groups", type=int, default=1000, help="distinct groups posted (default 1000)")
    parser.add_argument("--per-request", type=int, default=1, help="groups per post (default 1, Atropos's env client)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024; 128 with --smoke)")
    parser.add_argument("--after", type=float, default=3.0, help="seconds sampled after the queue is empty (default 3)")
    parser.add_argument("--skip-atropos", action="store_true")
    parser.add_argument("--versus", default=None, metavar="DIR",
                        help="also ours from the checkout in DIR (e.g. `git archive` of an older commit), interleaved")
    parser.add_argument("--record", action="store_true",
                        help="append the JSON lines to bench/results/serve-memory.jsonl (default: a temporary directory)")
    args = parser.parse_args(argv)
    groups = 32 if args.smoke else args.groups
    seq_len = 128 if args.smoke else args.seq_len
    after_s = 1.0 if args.smoke else args.after
    if args.record or args.json_out or args.smoke:
        json_out = json_path("serve-memory", args)
    else:
        json_out = Path(tempfile.gettempdir()) / "rollout-factory-bench" / "serve-memory.jsonl"
    with_atropos = not args.skip_atropos and atropos_available()
    if not with_atropos and not args.skip_atropos:
        print(f"[bench] no atroposlib venv at {DEFAULT_VENV} (python -m bench.atropos_venv makes it): ours only", file=sys.stderr)

    def side(name: str) -> Side:
        return Side({"atropos": "atroposlib 0.4.0", "ours": "rollout-factory"}[name],
                    lambda: measure(name, groups, args.per_request, seq_len, after_s))

    sides = [side("atropos")] if with_atropos else []
    if args.versus:
        sides.append(Side(f"rollout-factory at {Path(args.versus).name}", lambda: measure(
            "ours", groups, args.per_request, seq_len, after_s, pythonpath=str(Path(args.versus).resolve()))))
    sides.append(side("ours"))
    result = compare("serve-memory", sides, pairs=pairs_from(args), json_out=json_out)
    print_comparison(result, json_out=json_out, title=(
        f"Server memory: {groups} groups of {GROUP_SIZE} x {seq_len} tokens, {args.per_request} per request, plain JSON, "
        f"8 persistent clients; drained in batches of {BATCH}; sampled every 50 ms, {after_s:g} s after the drain"))
    print_within(result, after_s)


if __name__ == "__main__":
    main()
