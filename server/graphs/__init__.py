"""Device-side graphs behind one protocol (`base.Graph`): forward(embeds [1,T,H], positions [1,T]) -> logits.

`jit` (compiled: Neuron, or the CPU trace), `hf` (transformers, the reference and the demo), `null` (benchmarks).
The only package that may import `server.vendor`; must not import the engine or the API."""
