"""Block naming where a deployment's shard store lives (a laptop directory or a shared filesystem)."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field

from factory.store import ShardStore


class ShardStoreBlock(Block):
    """Root directory of the shard store; swap the block to move a deployment onto shared storage."""

    _block_type_name = "Factory Shard Store"
    root: str = Field("./data", description="Local or mounted directory that holds <run_id>/shards/*.parquet.")

    def store(self) -> ShardStore:
        return ShardStore(self.root)
