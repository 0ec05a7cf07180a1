"""One row of logits -> the next token: bias, penalties, top-k, soft-cap, temperature, min-p, top-p, the draw, and a
constraint's mask applied to the row: pure functions, and a `Sampler` per request. Must not import the engine or the API."""
