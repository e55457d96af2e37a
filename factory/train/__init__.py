"""The GRPO trainer's plain code: advantages, loss, batching, the training step, checkpoints, metrics."""
