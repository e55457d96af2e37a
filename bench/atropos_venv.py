"""Find or make the separate virtualenv with atroposlib from PyPI, for side-by-side benchmarks.

The factory and atroposlib are never installed together: Atropos pins its own
fastapi/transformers and would disturb the factory's environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ATROPOSLIB_VERSION = "0.4.0"
DEFAULT_VENV = Path(os.environ.get("ATROPOS_VENV", Path(__file__).resolve().parent.parent / ".venv-atropos"))


def atropos_python(venv: Path = DEFAULT_VENV) -> Path:
    """Path of the venv's python, creating the venv and installing atroposlib on first use."""
    python = venv / "bin" / "python"
    marker = venv / f".atroposlib-{ATROPOSLIB_VERSION}"
    if not marker.exists():
        print(f"[bench] installing atroposlib=={ATROPOSLIB_VERSION} into {venv} (first run only)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"atroposlib=={ATROPOSLIB_VERSION}"], check=True)
        marker.touch()
    return python


if __name__ == "__main__":
    print(atropos_python())
