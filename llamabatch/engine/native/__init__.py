"""llama.cpp through llama-cpp-python: the process-wide backend and log (backend), and one owner
per native handle, each freed exactly once (handles)."""
