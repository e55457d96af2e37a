"""Datagen's per-chunk commit (`tasks.shards.write_shard`, what the write-shard task runs) on a local store vs an
s3:// store on a local moto S3 server this bench starts and stops: ms per first commit, ms per retried commit (the
chunk is committed already: nothing is written) and S3 requests per commit, from moto's request log.

    OMP_NUM_THREADS=1 python -m bench.shards.datagen_commit --chunks 40
    python -m bench.shards.datagen_commit --smoke      # 5 chunks

moto is a single-threaded Python server on this machine: read the s3 column as "cost in requests", not as S3's
speed. Commits are interleaved: local, s3, s3 again (the retry) for each chunk (10 groups of 4 x 64 tokens).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.local_s3 import start_local_s3
from factory.synthetic import synthetic_groups
from tasks.shards import write_shard

BUCKET = "datagen-commit-bench"
REQUEST = re.compile(r'"([A-Z]+) (/[^ ?]*)(\?[^ ]*)? HTTP')


def _start_moto(log: Path) -> tuple[subprocess.Popen, str]:
    return start_local_s3(log)  # moto logs one line per request, which `_requests` counts


def _requests(log: Path) -> list[str]:
    return [f"{m.group(1)}{' ' + m.group(3).split('&')[0].split('=')[0] if m.group(3) else ''}"
            for m in REQUEST.finditer(log.read_text())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    chunks = 5 if args.smoke else args.chunks
    with tempfile.TemporaryDirectory(prefix="datagen-commit-") as tmp:
        log = Path(tmp) / "moto.log"
        server, endpoint = _start_moto(log)
        saved = dict(os.environ)
        try:
            os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                              AWS_ENDPOINT_URL=endpoint)
            import pyarrow.fs as pafs

            pafs.S3FileSystem(endpoint_override=endpoint.split("://")[1], scheme="http", region="us-east-1",
                              access_key="bench", secret_key="bench", allow_bucket_creation=True).create_dir(BUCKET)
            local, url = str(Path(tmp) / "store"), f"s3://{BUCKET}/store"
            groups = list(synthetic_groups(10, group_size=4, seq_len=64, env="bench"))
            times: dict[str, list[float]] = {"local": [], "s3": [], "s3, retried": []}
            per_commit: list[int] = []
            kinds: Counter[str] = Counter()
            for chunk in range(chunks):
                for what, root in (("local", local), ("s3", url), ("s3, retried", url)):
                    seen = len(_requests(log))
                    started = time.perf_counter()
                    record = write_shard(root, "run", "w", chunk, groups)
                    times[what].append(time.perf_counter() - started)
                    assert record.skipped == (what == "s3, retried")
                    if what == "s3":
                        time.sleep(0.05)  # moto writes its log line after the answer
                        new = _requests(log)[seen:]
                        per_commit.append(len(new))
                        kinds.update(new)
        finally:
            os.environ.clear()
            os.environ.update(saved)
            server.terminate()
            server.wait(timeout=10)
    print(f"{chunks} chunks of 10 groups (4 x 64 tokens); load average {os.getloadavg()[0]:.2f}\n")
    print("| commit | median ms | max ms |\n|---|---|---|")
    for what, values in times.items():
        print(f"| {what} | {statistics.median(values) * 1000:.1f} | {max(values) * 1000:.1f} |")
    print(f"\nS3 requests per first commit: median {statistics.median(per_commit):g} "
          f"({', '.join(f'{k} {v / chunks:g}' for k, v in sorted(kinds.items()))} per commit)")


if __name__ == "__main__":
    main()
