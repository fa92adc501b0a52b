"""Prefill tier: runs prompt prefill on a vLLM engine (KV producer) and leaves the
prompt's paged KV under a lease for a decode worker."""
