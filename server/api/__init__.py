"""The HTTP layer: OpenAI-compatible routes over the engine (`app.create_app`; `server.app.serve` runs it).

Owns validation, chat planning, SSE and error JSON. Must not import torch, the graphs or the model files, nor touch
the filesystem; nothing is imported here, so importing `server.api` pulls in no web framework.
"""
