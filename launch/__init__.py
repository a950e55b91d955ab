"""absl entry points (train, learner, worker, generate, evaluate)."""
