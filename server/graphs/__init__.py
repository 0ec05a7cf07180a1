"""Device-side graphs behind one protocol (`base.Graph`): `jit` (compiled: Neuron, or the CPU trace), `hf` (transformers),
`null` (benchmarks). The only package that may import `server.vendor`; must not import the engine or the API."""
