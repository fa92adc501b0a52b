"""The front door: validation, tokenization in a process pool, routing to the prefill and
decode tiers, and streaming detokenized text back."""
