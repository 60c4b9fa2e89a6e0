"""Sampling: each sequence's parameters and sampler, truncation without a sort, a step's picks,
llama.cpp's own chain for its further samplers, and constrained output (masks, JSON bounds, thoughts)."""
