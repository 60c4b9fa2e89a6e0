"""Scheduling: the waiting queue by aged priority, the slots and their cached prefixes, prefix
leaders, what each step carries, and deterministic fillers."""
