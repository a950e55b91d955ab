"""The learner: sharded jitted update, optimizer, checkpoints, metrics."""
