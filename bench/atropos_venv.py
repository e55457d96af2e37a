"""Find or make the separate virtualenv with atroposlib from PyPI, for side-by-side benchmarks.

The factory and atroposlib are never installed together: Atropos pins its own
fastapi/transformers and would disturb the factory's environment.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

ATROPOSLIB_VERSION = "0.4.0"
DEFAULT_VENV = Path(os.environ.get("ATROPOS_VENV", Path(__file__).resolve().parent.parent / ".venv-atropos"))


def _marker(venv: Path) -> Path:
    return venv / f".atroposlib-{ATROPOSLIB_VERSION}"


def atropos_available(venv: Path = DEFAULT_VENV) -> bool:
    """Whether the venv is already built (smoke runs use Atropos only then, never installing it)."""
    return _marker(venv).exists()


def atropos_python(venv: Path = DEFAULT_VENV) -> Path:
    """Path of the venv's python, creating the venv and installing atroposlib on first use (one installer at a time)."""
    python = venv / "bin" / "python"
    if _marker(venv).exists():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another bench may be installing it right now
        if not _marker(venv).exists():
            print(f"[bench] installing atroposlib=={ATROPOSLIB_VERSION} into {venv} (first run only)", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", f"atroposlib=={ATROPOSLIB_VERSION}"],
                           check=True)
            _marker(venv).touch()
    return python


if __name__ == "__main__":
    print(atropos_python())
