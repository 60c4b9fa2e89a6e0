"""The measure wing: throughput sweeps against native llama.cpp, plots, determinism checks.
It imports the engine wing (and top-level errors/catalog); never serve, jobs or cli."""
