"""Start-up of the export CLIs: atroposlib 0.4.0's `atropos-sft-gen` vs the factory's, interleaved.

A stdlib HTTP server stands in for run-api: it answers /reset_data and /register, then serves one batch of
`--groups` groups on the first GET /batch. Per run it records, from the CLI's launch: when /register arrived,
and when the CLI exited after writing `--rows` rows (text rows decoded with the starter policy's tokenizer, or
message rows with --save-messages), and the CPU seconds the CLI used (user + system; steadier than the times on a
loaded machine). Nothing is written inside the repo.

    python -m bench.export.startup --pairs 5            # text rows (both CLIs load the tokenizer)
    python -m bench.export.startup --pairs 5 --save-messages
    python -m bench.export.startup --pairs 5 --cold      # also ours without its saved decoder (transformers loaded)
    python -m bench.export.startup --pairs 5 --baseline /tmp/main-copy   # also the factory CLI of another checkout

Text rows: the factory CLI decodes with the decoder an earlier run saved (factory/export/decode_cache.py; one untimed
run saves it, in a temporary directory), as every run after a tokenizer's first does; `--cold` adds the first-run case.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench.atropos_venv import atropos_python

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "models" / "starter-policy"


class _Api(BaseHTTPRequestHandler):
    batch: bytes = b""
    registered_at: float | None = None
    served = False

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/reset_data":
            self._send(b"Reset successful", "text/plain")
        elif self.path == "/batch":
            cls = type(self)
            body = b'{"batch": null}' if cls.served else cls.batch
            cls.served = True
            self._send(body)
        else:
            self._send(b"{}")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).registered_at = time.perf_counter()
        self._send(b'{"uuid": 1}')


def _groups(count: int) -> list[dict]:
    from tokenizers import Tokenizer

    encode = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")).encode
    out = []
    for i in range(count):
        prompt = encode(f"<|im_start|>user\nWhat is {i} + {i}?<|im_end|>\n<|im_start|>assistant\n").ids
        completions = [encode(f"It is {2 * i + k}.<|im_end|>").ids for k in range(4)]
        out.append({"tokens": [prompt + c for c in completions], "masks": [[-100] * len(prompt) + c for c in completions],
                    "scores": [1.0, 0.5, 0.25, 0.0],
                    "messages": [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{k}"}]
                                 for k in range(4)]})
    return out


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _one(command: list[str], out: Path, root: Path = ROOT, env: dict[str, str] | None = None
         ) -> tuple[float, float, float]:
    """(/register at, exit at, the CLI's CPU seconds: user + system, all its threads) of one run."""
    _Api.registered_at, _Api.served = None, False
    out.unlink(missing_ok=True)
    cpu_before = _children_cpu_s()
    started = time.perf_counter()
    # cwd=root: `python -c` imports from the current directory first (a --baseline checkout is not shadowed)
    result = subprocess.run([*command, str(out)], capture_output=True, text=True, cwd=root,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root), **(env or {})})
    ended = time.perf_counter()
    if result.returncode != 0 or _Api.registered_at is None:
        raise RuntimeError(f"{command[0]} failed: {result.stderr[-2000:]}")
    return _Api.registered_at - started, ended - started, _children_cpu_s() - cpu_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--save-messages", action="store_true")
    parser.add_argument("--cold", action="store_true",
                        help="Also run the factory CLI without its saved decoder (FACTORY_DECODE_CACHE=off)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="Also run the factory CLI of this checkout (e.g. a `git archive` of main), interleaved")
    args = parser.parse_args()
    _Api.batch = json.dumps({"batch": _groups(args.groups)}).encode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    common = ["--api-url", url, "--group-size", "4", "--tokenizer", str(TOKENIZER), "--num-seqs-to-save",
              str(args.rows), *(["--save-messages"] if args.save_messages else [])]
    ours = [sys.executable, "-c", "from factory.export.cli import sft_main; sft_main()", *common]
    with tempfile.TemporaryDirectory() as work:
        saved = {"FACTORY_DECODE_CACHE": str(Path(work) / "decoders")}
        sides = {"atroposlib 0.4.0": ([str(atropos_python().parent / "atropos-sft-gen"), *common], ROOT, None),
                 "factory": (ours, ROOT, saved)}
        if args.cold and not args.save_messages:
            sides["factory, cold"] = (ours, ROOT, {"FACTORY_DECODE_CACHE": "off"})
        if args.baseline is not None:
            sides["factory baseline"] = (ours, args.baseline.resolve(), saved)
        if not args.save_messages:
            _one(ours, Path(work) / "out.jsonl", ROOT, saved)  # untimed: saves the decoder the timed runs load
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in sides}
        for _ in range(args.pairs):
            for name, (command, root, env) in sides.items():
                results[name].append(_one(command, Path(work) / "out.jsonl", root, env))
    server.shutdown()
    mode = "message rows" if args.save_messages else "text rows"
    print(f"export CLI start-up, {mode}, {args.pairs} interleaved rounds (seconds from launch; median [min-max]); "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, runs in results.items():
        reg, done, cpu = ([r[i] for r in runs] for i in range(3))
        print(f"  {name:18s} /register at {statistics.median(reg):.2f} [{min(reg):.2f}-{max(reg):.2f}]   "
              f"{args.rows} rows written, exit at {statistics.median(done):.2f} [{min(done):.2f}-{max(done):.2f}]   "
              f"CPU {statistics.median(cpu):.2f} [{min(cpu):.2f}-{max(cpu):.2f}]")


if __name__ == "__main__":
    main()
