"""The serve wing: the OpenAI-compatible HTTP server, its engine thread, streamed replies, metrics.
It imports the engine wing, openai_format and the top-level errors/catalog; never jobs, measure or cli."""
