"""Token constraints: what a request allows the model to write, as a value and as a per-step vocabulary mask. Torch-free;
knows no model family (server.protocol sits above it): a family's markers and call grammar come in through `CallFormat`."""
