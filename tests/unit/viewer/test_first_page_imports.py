"""The viewer's first page reads rows without pyarrow pulling in pandas (~0.5 s of the first page at 10k shards)."""

import os
import subprocess
import sys

_SCRIPT = """
import sys
from pathlib import Path
from factory.store import ShardStore
from factory.viewer.index import RunIndex

root = Path(sys.argv[1])
assert "pandas" not in sys.modules
index = RunIndex(ShardStore(root), "gen")
index.refresh()
rows = index.read_rows(index.frame.head(25), ["group_id", "item_key"])
assert [r["item_key"] for r in rows] == [f"item-{i:010d}" for i in range(25)], rows  # factory.synthetic_store.item_key
print("pandas" in sys.modules)
"""


def test_first_page_does_not_import_pandas(tmp_path):
    from bench.shards.scale import RUN, build_store

    assert RUN == "gen"
    build_store(tmp_path / "store", 3)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "store")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
