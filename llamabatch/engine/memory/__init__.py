"""Memory: what each sequence's KV cache or recurrent state holds and the one place that changes
it (streams), prompts kept past their slot (prompt_cache), and what an admitted sequence reuses."""
