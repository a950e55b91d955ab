"""Rollout: engine protocol, embedded JAX engine, SGLang client, agent loop."""
