"""The HTTP layer: OpenAI-compatible routes over the engine (see `app.create_app`; `server.serve` runs it).

Nothing is imported here, so importing `server.api` has no side effects and pulls in no web framework.
"""
