"""Decode tier: a vLLM engine (KV consumer) running continuous batching on prompts whose
KV arrived from a prefill worker."""
