"""A local S3-compatible server (moto's server mode) on a free port, for the object-store bench and tests.

The caller stops it (`server.terminate(); server.wait()`). Nothing here talks to a remote server."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def start_local_s3(log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """(the moto server process, its endpoint URL), once the server answers (or after ~10 s of trying). `log`
    receives moto's output (one line per request), else it is dropped."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if log is None:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
    else:
        with open(log, "w") as out:
            server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=out, stderr=out)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except OSError:
            time.sleep(0.05)
    return server, endpoint
