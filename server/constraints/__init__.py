"""Token constraints: grammars (llguidance) and token sets compiled into per-step vocabulary masks. Torch-free.

constraint.py: the value a request carries (`ConstraintSpec`), the matchers built from it, the `CallFormat` a chat
protocol fills in; planner.py: a request's fields -> a value; json_schema.py: response_format -> grammar; vocab.py:
the grammar vocabulary and its loader. A model family's call syntax comes in through `CallFormat`; must not import a
model family (server.protocol sits above it: tests/test_constraints.py checks) nor torch."""
