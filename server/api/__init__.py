"""The HTTP layer: OpenAI-compatible routes, validation, chat planning, SSE, error JSON (`app.create_app`). Must not import
torch, the graphs or the model files, nor touch the filesystem; this file imports nothing (no web framework on import)."""
