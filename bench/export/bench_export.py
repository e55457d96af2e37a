"""SFT export rows/s: the factory's `atropos-sft-gen` (shard store) vs atroposlib's `atropos-sft-gen` (run-api).

    ATROPOS_VENV=/work/.venv-atropos python -m bench.export.run    # issue 29's size: 2048 groups x 8 x 1024 tokens
    python -m bench.export.run --smoke                                          # seconds (CI)
    python -m bench.export.run --api --groups 2048    # both CLIs with --api-url against their own run-api: CLI CPU per row
                                                      # (ours twice: Arrow /batch, and JSON /batch with --api-json)
    python -m bench.export.run --memory 100000,1000000    # peak RSS of exports of two sizes
    BENCH_DEDUP=0 python -m bench.export.run --memory ...  # the same without the dedup set

Both sides get the same synthetic groups (8 sequences of `--seq-len` tokens each) and the same rules
(top 3 per group, positive scores, message lists). Atropos's CLI reads them
from its run-api, which the bench starts in atroposlib's venv and fills through
/scored_data_list once the CLI has registered; the factory reads the store.
Each side is timed from the start of its command to its exit (Atropos's from
the first POST, so filling its queue overlaps its reading). The sides run in
interleaved rounds (bench/harness.py), atroposlib's the baseline of the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from bench.atropos_venv import atropos_available, atropos_python  # noqa: E402
from factory.inference.local_server import free_port  # noqa: E402
from factory.store import ShardStore  # noqa: E402
from factory.synthetic import synthetic_group  # noqa: E402
from environments.groups import GROUP_WIRE_FIELDS  # noqa: E402

GROUP_SIZE = 8
TOP_N = 3


def make_store(root: Path, groups: int, seq_len: int = 64) -> tuple[list[bytes], int]:
    """Commit `groups` synthetic groups in chunks of 256. Returns the chunks as JSON bodies for Atropos's
    /scored_data_list (lists of wire dicts; bytes, not Python objects: at 8 x 1024 tokens a group is ~250 KB of JSON)
    and the rows an export of them writes."""
    store = ShardStore(root)
    bodies, chunk, rows = [], [], 0
    for index in range(groups):
        group = synthetic_group(index, group_size=GROUP_SIZE, seq_len=seq_len, run_id="bench")
        chunk.append(group)
        rows += min(TOP_N, sum(1 for s in group.scores if s > 0))
        if len(chunk) == 256 or index == groups - 1:
            store.commit("bench", "w0", index // 256, chunk)
            fields = set(GROUP_WIRE_FIELDS)
            bodies.append(b"[" + b",".join(g.model_dump_json(include=fields).encode() for g in chunk) + b"]")
            chunk = []
    return bodies, rows


def tiny_tokenizer(directory: Path) -> Path:
    """A local tokenizer dir: atroposlib's CLI loads one at start even with --save-messages, and the hub is offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["benchmark text"] * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(directory)
    return directory


def run_factory(store: Path, out: Path) -> tuple[float, int]:
    """The factory's atropos-sft-gen reading the shard store directly."""
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "from factory.export.cli import sft_main; sft_main()", str(out), "--store", str(store),
         "--save-top-n-per-group", str(TOP_N), "--save-messages", "--quiet"],
        check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
    )
    seconds = time.perf_counter() - started
    return seconds, sum(1 for _ in open(out))


def _wait_http(url: str, deadline_s: float = 120) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def export_through_api(api_command: list[str], cli_command: list[str], wire: list[bytes], work: Path, port: int,
                       out: Path, env: dict[str, str]) -> tuple[float, int, float]:
    """Start a run-api, start an exporter CLI against it, fill the API once the CLI has registered; wait for the CLI.

    Returns (seconds from the first POST to the CLI's exit, rows written, the CLI process's own CPU seconds).
    """
    api = subprocess.Popen(api_command, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{url}/")
        cpu_before = _children_cpu_s()
        cli = subprocess.Popen([*cli_command, str(out), "--api-url", url], env=env, cwd=work,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with httpx.Client(timeout=120) as client:
            while client.get(f"{url}/info").json().get("batch_size", -1) == -1:  # the CLI (resets, then) registers
                time.sleep(0.05)
            started = time.perf_counter()
            for body in wire:
                client.post(f"{url}/scored_data_list", content=body,
                            headers={"content-type": "application/json"}).raise_for_status()
        if cli.wait(timeout=3600) != 0:
            raise RuntimeError(f"{cli_command[0]} failed")
        seconds = time.perf_counter() - started
        cli_cpu = _children_cpu_s() - cpu_before  # only the CLI was reaped in between
    finally:
        api.terminate()
        api.wait(timeout=30)
    return seconds, sum(1 for _ in open(out)), cli_cpu


def _offline_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_atropos(wire: list[bytes], rows: int, work: Path, port: int, out: Path) -> tuple[float, int, float]:
    bin_dir = atropos_python().parent
    cli = [str(bin_dir / "atropos-sft-gen"), "--group-size", str(GROUP_SIZE), "--tokenizer", str(tiny_tokenizer(work / "tok")),
           "--save-messages", "--save-top-n-per-group", str(TOP_N), "--num-seqs-to-save", str(rows)]
    return export_through_api([str(bin_dir / "run-api"), "--port", str(port)], cli, wire, work, port, out, _offline_env())


def run_factory_api(wire: list[bytes], rows: int, work: Path, port: int, out: Path, *, json_batches: bool = False
                    ) -> tuple[float, int, float]:
    """The factory's atropos-sft-gen with --api-url against the factory's run-api (a fresh store each time).

    It reads /batch as an Arrow stream, or as JSON (Atropos's format) with `json_batches` (--api-json).
    """
    store = Path(tempfile.mkdtemp(prefix="api-store-", dir=work))
    api = [sys.executable, "-m", "factory.serve.cli", "--port", str(port), "--host", "127.0.0.1", "--store_root", str(store),
           "--log_level", "warning"]
    cli = [sys.executable, "-c", "from factory.export.cli import sft_main; sft_main()", "--group-size", str(GROUP_SIZE),
           "--save-messages", "--save-top-n-per-group", str(TOP_N), "--num-seqs-to-save", str(rows), "--quiet",
           *(["--api-json"] if json_batches else [])]
    env = {**_offline_env(), "PYTHONPATH": str(ROOT)}
    try:
        return export_through_api(api, cli, wire, work, port, out, env)
    finally:
        shutil.rmtree(store, ignore_errors=True)


def _side(run, rows: int, out: Path):
    """A harness side: one export into a fresh `out`; rows/s, and the row count checked against the expected."""
    def measure() -> dict:
        out.unlink(missing_ok=True)
        seconds, written, *cli_cpu = run(out)
        if written != rows:
            raise RuntimeError(f"{out.name}: wrote {written} rows, expected {rows}")
        result = {"rows/s": written / seconds, "seconds": seconds}
        if cli_cpu:
            result["CLI CPU ms per row"] = 1000 * cli_cpu[0] / written
        return result
    return measure


def speed(groups: int, *, pairs: int, json_out: Path | None, with_atropos: bool, through_api: bool = False,
          seq_len: int = 1024) -> None:
    """Both exporters in interleaved rounds over the same groups (atroposlib's the baseline)."""
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        work = Path(tmp)
        wire, rows = make_store(work / "store", groups, seq_len)
        if through_api:
            sides = [harness.Side("factory atropos-sft-gen --api-url (factory run-api, Arrow /batch)",
                                  _side(lambda out: run_factory_api(wire, rows, work, free_port(), out), rows,
                                        work / "factory_sft.jsonl")),
                     harness.Side("factory atropos-sft-gen --api-url --api-json (factory run-api, JSON /batch)",
                                  _side(lambda out: run_factory_api(wire, rows, work, free_port(), out, json_batches=True),
                                        rows, work / "factory_sft_json.jsonl"))]
        else:
            sides = [harness.Side("factory atropos-sft-gen (shard store)",
                                  _side(lambda out: run_factory(work / "store", out), rows, work / "factory_sft.jsonl"))]
        if with_atropos:
            sides.insert(0, harness.Side("atroposlib 0.4.0 atropos-sft-gen (run-api)",
                                         _side(lambda out: run_atropos(wire, rows, work, free_port(), out), rows,
                                               work / "atropos_sft.jsonl")))
        result = harness.compare("export", sides, pairs=pairs, json_out=json_out,
                                 label=f"{groups} groups x {GROUP_SIZE} x {seq_len} tokens")
    harness.print_comparison(result, title=f"SFT export of {groups} groups x {GROUP_SIZE} x {seq_len} tokens (top {TOP_N}, "
                                           f"positive scores, messages, no dedup): {rows} rows each", json_out=json_out)


def _rss_child(store: str, out: str) -> None:
    import resource

    from factory.export import OutputConfig, SelectionConfig, SftExportConfig, SourceConfig, export_sft

    dedup = os.environ.get("BENCH_DEDUP", "1") != "0"
    stats = export_sft(SftExportConfig(source=SourceConfig(store=store), select=SelectionConfig(dedup=dedup),
                                       output=OutputConfig(path=out)))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"groups": stats.groups_in, "rows": stats.rows_out, "seconds": stats.seconds, "peak_mb": peak_mb}))


def make_big_store(root: Path, groups: int) -> None:
    """Many distinct groups quickly: 512 base groups, re-committed with a per-chunk marker in every message."""
    store = ShardStore(root)
    base = [synthetic_group(i, group_size=GROUP_SIZE, seq_len=32, run_id="big") for i in range(512)]
    for chunk in range((groups + 511) // 512):
        take = base[: min(512, groups - chunk * 512)]
        store.commit("big", "w0", chunk, [
            g.model_copy(update={"messages": [[{**m, "content": f"{m['content']} #{chunk}"} for m in convo]
                                              for convo in g.messages]}) for g in take
        ])


def memory(sizes: list[int]) -> None:
    print("\n| groups | rows out | seconds | rows/s | peak RSS MiB |\n|---:|---:|---:|---:|---:|")
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="bench-export-mem-") as tmp:
            make_big_store(Path(tmp) / "store", size)
            result = subprocess.run(
                [sys.executable, __file__, "--rss-child", str(Path(tmp) / "store"), str(Path(tmp) / "out")],
                check=True, capture_output=True, text=True, cwd=ROOT,
            )
            r = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"| {r['groups']:,} | {r['rows']:,} | {r['seconds']:.1f} | {r['rows'] / r['seconds']:,.0f} | {r['peak_mb']:.0f} |",
                  flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2048,
                        help="Groups for the side-by-side run (default 2048: issue 29's ~2000 distinct groups)")
    parser.add_argument("--seq-len", type=int, default=1024,
                        help="Tokens per sequence (default 1024, issue 29's size; runs before 2026-11-27 used 64)")
    parser.add_argument("--memory", default=None, help="Comma-separated store sizes (groups) for the peak-RSS run.")
    parser.add_argument("--skip-atropos", action="store_true", help="leave out atroposlib's exporter")
    parser.add_argument("--api", action="store_true", help="the factory's CLI reads through its run-api (--api-url), as Atropos's does")
    parser.add_argument("--rss-child", nargs=2, help=argparse.SUPPRESS)
    harness.add_bench_args(parser)
    args = parser.parse_args(argv)
    if args.rss_child:
        _rss_child(*args.rss_child)
        return
    with_atropos = not args.skip_atropos
    if args.smoke:
        args.groups, args.seq_len = 64, 64
        args.memory = args.memory and "256"
        if with_atropos and not atropos_available():
            print("[bench] no Atropos venv (bench/atropos_venv.py); smoke run leaves that side out", file=sys.stderr)
            with_atropos = False
    if args.memory:
        memory([int(s) for s in args.memory.split(",")])
    else:
        speed(args.groups, pairs=harness.pairs_from(args), json_out=harness.json_path("export-api" if args.api else "export", args),
              with_atropos=with_atropos, through_api=args.api, seq_len=args.seq_len)


if __name__ == "__main__":
    main()
