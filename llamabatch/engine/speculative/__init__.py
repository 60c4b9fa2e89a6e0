"""Speculative decoding: drafts proposed (prompt lookup or a draft model), planned where measuring
says they pay, verified in the step's one decode (greedy, or by rejection sampling)."""
