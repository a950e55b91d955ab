"""The test suite (`make test`); tests/conftest.py sets up each test process."""

# XLA flags for every JAX process of the suite: the test processes (which add 8 forced host
# devices) and the launches they start. LLVM at optimisation level 0 compiles about 30%
# faster, and the tiny models' programs run no slower for it on the whole (measured on 2
# cores: test_model_internal + test_attention + test_learner 206 s -> 143 s, the learning
# guard, replication, transport, MoE learner and engine files 250 s -> 196 s). Benchmarks,
# the device check and user launches compile at XLA's default.
XLA_TEST_FLAGS = "--xla_backend_optimization_level=0"
