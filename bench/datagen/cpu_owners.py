"""Who holds a warm datagen flow's CPU: Prefect, the flow's own bookkeeping, or the data path (issue 33).

    OMP_NUM_THREADS=1 python -m bench.datagen.cpu_owners --groups 24000 --calls 4 --chunk-items 3000 --server-token-ids
    python -m bench.datagen.cpu_owners --smoke

Runs `bench.datagen.flow_profile` (one process: Prefect server, instant server, the flow called `--calls` times)
and, once its first call (imports, tokenizer, Prefect engine start) has ended, samples it with py-spy
(`--gil --nonblocking`: only the thread holding the GIL, the process not paused). Each sample's stack is given
to one owner (`owner`):

- a data-path stage when the stack is inside one (the deepest stage frame wins): generate (items, HTTP, parse,
  tokenize), score, group, commit (Arrow build, Parquet, commit log), and the hand-over between them in the
  rollout task (tasks/rollout.py: mostly freeing a chunk's rollouts once it is grouped);
- else Prefect (engine, API client, log and event shipping, its event-loop threads);
- else the flow's bookkeeping (factory/datagen, flows/: planning, window, progress);
- the bench's own work (a stack with a bench/ frame and no Prefect frame: hashing each call's rows) is left out.

"orchestration" = Prefect + bookkeeping, as a share of the GIL-holding samples. The GIL is the flow's bottleneck
(one core's worth of Python; the Parquet write runs outside it and is undercounted here, as it costs no GIL time).
This is what `flow_profile --plain` cannot separate: the flow's CPU over the plain worker's also holds what the
pipeline itself costs (two chunks alive for the garbage collector, three threads) beside Prefect's engine.

Needs py-spy (`pip install py-spy`; not a project dependency) and permission to sample a child process (root, or
kernel.yama.ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from bench import harness

STAGES = ("generate", "score", "group", "commit", "chunk hand-over")
OWNERS = (*STAGES, "Prefect", "flow bookkeeping", "other")

_STAGE_FRAMES = (  # (stage, path fragments of its frames); `to_record_batch` is the commit's Arrow build
    ("commit", ("to_record_batch", "factory/store.py", "tasks/shards.py", "factory/commit_log.py", "factory/schema.py")),
    ("group", ("tasks/group.py", "factory/group_columns.py", "environments/groups.py")),
    ("score", ("tasks/score.py", "tasks/scoring_pool.py")),
    ("generate", ("tasks/generate.py", "factory/inference/")),
    ("chunk hand-over", ("tasks/rollout.py",)),  # between the steps: mostly freeing a grouped chunk's rollouts
)
_IDLE_LEAVES = ("select (selectors.py", "wait (threading.py", "_wait_for_tstate_lock")


def owner(frames: list[str]) -> str | None:
    """The owner of one sample (frames root first, as py-spy's raw format gives them); None for the bench's own
    work or an idle leaf (py-spy --gil should give none of those; they are dropped if it does)."""
    if not frames or any(leaf in frames[-1] for leaf in _IDLE_LEAVES):
        return None
    in_prefect = any("(prefect/" in frame for frame in frames)
    if not in_prefect and any("(bench/" in frame for frame in frames):  # the bench's own: counting, hashing rows
        return None
    for frame in reversed(frames):  # the deepest stage frame: env.score under tasks/scoring_pool.py is "score"
        for stage, fragments in _STAGE_FRAMES:
            if any(fragment in frame for fragment in fragments):
                return stage
    for frame in reversed(frames):  # the deeper of Prefect's code and the flow's: a log record is Prefect's
        if "(prefect/" in frame:
            return "Prefect"
        if "(factory/" in frame or "(flows/" in frame or "(tasks/" in frame:
            return "flow bookkeeping"
    return "other"


def parse_raw(lines: Iterable[str]) -> Iterable[tuple[list[str], int]]:
    """py-spy's raw (collapsed) lines: `frame;frame;...;leaf count` -> (frames, count)."""
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


def owners(lines: Iterable[str]) -> tuple[Counter[str], dict[str, Counter[str]]]:
    """Samples per owner, and per owner the leaf frames where its samples end."""
    by_owner: Counter[str] = Counter()
    leaves: dict[str, Counter[str]] = {}
    for frames, count in parse_raw(lines):
        who = owner(frames)
        if who is None:
            continue
        by_owner[who] += count
        leaves.setdefault(who, Counter())[frames[-1]] += count
    return by_owner, leaves


def sample_flow(args: argparse.Namespace, raw: Path) -> list[str]:
    """Run flow_profile, attach py-spy after its first (cold) call, return flow_profile's output lines."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).is_file():
        raise SystemExit("cpu_owners needs py-spy: pip install py-spy (it is not a project dependency)")
    command = [sys.executable, "-m", "bench.datagen.flow_profile", "--groups", str(args.groups), "--calls",
               str(args.calls + 1), "--chunk-items", str(args.chunk_items),
               *(["--server-token-ids"] if args.server_token_ids else [])]
    profile = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=Path(__file__).resolve().parents[2])
    sampler = None
    output = []
    assert profile.stdout is not None
    for line in profile.stdout:
        output.append(line)
        if sampler is None and line.startswith("call 0 "):  # the cold call is over: sample the warm ones
            sampler = subprocess.Popen([py_spy, "record", "--pid", str(profile.pid), "--gil", "--nonblocking",
                                        "--rate", str(args.rate), "--format", "raw", "--output", str(raw)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    profile.wait()
    if sampler is None:
        raise SystemExit("flow_profile ended before its first call:\n" + "".join(output[-40:]))
    _, errors = sampler.communicate(timeout=60)
    if profile.returncode or not raw.is_file():
        raise SystemExit(f"flow_profile exited {profile.returncode}; py-spy: {errors[-1000:]}\n"
                         + "".join(output[-40:]))
    return output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=24000, help="groups per flow call")
    parser.add_argument("--calls", type=int, default=4, help="warm flow calls sampled (after one cold call)")
    parser.add_argument("--chunk-items", type=int, default=3000)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--server-token-ids", action="store_true",
                        help="the server returns token ids and the flow asks for them (vLLM's return_token_ids)")
    parser.add_argument("--smoke", action="store_true", help="seconds: 600 groups, 2 warm calls")
    parser.add_argument("--json-out", type=Path, default=harness.RESULTS_DIR / "datagen-cpu-owners.jsonl")
    args = parser.parse_args(argv)
    if args.smoke:
        args.groups, args.calls, args.chunk_items = 600, 2, 150
    work = Path(tempfile.mkdtemp(prefix="bench-cpu-owners-"))
    try:
        output = sample_flow(args, work / "samples.txt")
        with (work / "samples.txt").open() as lines:
            by_owner, leaves = owners(lines)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = sum(by_owner.values())
    if not total:
        raise SystemExit("py-spy recorded no samples holding the GIL")
    calls = [line.strip() for line in output if line.startswith("call ")]
    print("\n".join(calls))
    rows = [(who, by_owner[who], f"{100 * by_owner[who] / total:.1f}%") for who in OWNERS]
    orchestration = by_owner["Prefect"] + by_owner["flow bookkeeping"]
    rows.append(("orchestration (Prefect + bookkeeping)", orchestration, f"{100 * orchestration / total:.1f}%"))
    harness.print_table(["owner", "GIL samples", "share"], rows,
                        title=f"who holds the GIL in {args.calls} warm flow calls of {args.groups} groups, chunks of "
                              f"{args.chunk_items} ({'server ids' if args.server_token_ids else 'no ids'})")
    for who in ("Prefect", "flow bookkeeping", "other"):
        harness.print_table([f"{who}: leaf frame", "GIL samples"],
                            [(leaf[:110], n) for leaf, n in leaves.get(who, Counter()).most_common(8)],
                            title=f"where the samples of '{who}' end")
    if not args.smoke:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        with args.json_out.open("a") as out:
            out.write(json.dumps({"bench": "datagen-cpu-owners", "time": time.time(),
                                  "command": harness.command_line(), "machine": harness.machine(),
                                  "groups": args.groups, "calls": args.calls, "chunk_items": args.chunk_items,
                                  "server_token_ids": args.server_token_ids, "samples": dict(by_owner),
                                  "orchestration_share": orchestration / total, "calls_output": calls}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
