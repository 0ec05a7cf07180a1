"""Token constraints: what a request allows the model to write, enforced as a vocabulary mask every step.

Torch-free, so the API layer can plan and validate constraints; knows no model family (server.protocol sits above it):
a family's markers and call grammar come in through `CallFormat` (constraint.py)."""
