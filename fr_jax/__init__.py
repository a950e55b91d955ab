"""fr_jax: FlashREINFORCE in JAX/Flax."""

__version__ = "0.1.0"
