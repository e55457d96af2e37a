"""The batching API: Atropos's trainer/env HTTP protocol served from durable Parquet shards."""
