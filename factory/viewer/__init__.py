"""`view-run`: a live web viewer over the shard store (runs, groups, filters, plots), read straight from Parquet.

    view-run --store ./data                 # http://127.0.0.1:8080, localhost only
    python -m factory.viewer --store ./data --run run-1 --host 0.0.0.0 --token SECRET

`index.py` keeps a small per-run index (one row per group: env, family,
difficulty, policy version, scores, lengths, where the row lives) that grows
shard by shard as the commit log grows; filters run on that index, and only
the rows a page shows are read back from their shard's row group. `render.py`
holds the templates shared with `process` mode's `groups.html`.
"""
