"""Policy models: one NNX decoder for Llama / Qwen2 / Qwen3, checkpoints, tokenizers."""
